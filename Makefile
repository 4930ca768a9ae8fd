# The two commands a newcomer needs (each sets up .venv first if needed):
#   make demo   - GRPO with drafter co-training on the tiny built-in model (CPU, a few minutes)
#   make test   - the test suite
PY := .venv/bin/python

.PHONY: setup demo test test-fast warm bench clean mutants gpu-wheels

setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m cotrain.models.build_tiny
	$(PY) launch/grpo.py --config configs/demo.yaml --overwrite $(ARGS)

test: setup
	$(PY) -m pytest $(ARGS)

# builds the models and drafters the tests, bench and demo use into the cache (~/.cache/cotrain), the
# same locked, atomic builds they would run on first use: once on a fresh machine, before them
warm: setup
	$(PY) scripts/warm_caches.py $(ARGS)

test-fast: setup
	$(PY) -m pytest -m "not slow" $(ARGS)

# planted bugs, one at a time, against their focused tests (minutes; not part of test / CI): docs/testing.md
mutants: setup
	$(PY) scripts/mutants.py $(ARGS)

# the wheels (and the built tiny model) the GPU check carries to a GPU machine without network: docs/setup.md
gpu-wheels: setup
	bash scripts/gpu_wheels.sh $(ARGS)

clean:
	rm -rf runs .pytest_cache
