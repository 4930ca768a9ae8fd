# The two commands a newcomer needs (each sets up .venv first if needed):
#   make demo   - GRPO with drafter co-training on the tiny built-in model (CPU, a few minutes)
#   make test   - the test suite
PY := .venv/bin/python

.PHONY: setup demo test test-fast bench clean mutants

setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m cotrain.models.build_tiny
	$(PY) launch/grpo.py --config configs/demo.yaml --overwrite $(ARGS)

test: setup
	$(PY) -m pytest $(ARGS)

test-fast: setup
	$(PY) -m pytest -m "not slow" $(ARGS)

# planted bugs, one at a time, against their focused tests (minutes; not part of test / CI): docs/testing.md
mutants: setup
	$(PY) scripts/mutants.py $(ARGS)

clean:
	rm -rf runs .pytest_cache
