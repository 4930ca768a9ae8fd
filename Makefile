# The two commands a newcomer needs (each sets up .venv first if needed):
#   make demo   - GRPO with drafter co-training on the tiny built-in model (CPU, a few minutes)
#   make test   - the test suite
PY := .venv/bin/python

.PHONY: setup demo test test-fast bench clean mutants gpu-wheels

setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m cotrain.models.build_tiny
	$(PY) launch/grpo.py --config configs/demo.yaml --overwrite $(ARGS)

# The whole suite (no ARGS) starts scripts/warm_caches.py beside pytest: on a clean machine it builds
# the models and drafters the tests need on the core the (one-thread) test process leaves idle.
test: setup
	@warm=; log=$$(mktemp); \
	if [ -z "$(strip $(ARGS))" ]; then $(PY) scripts/warm_caches.py --nice 19 >"$$log" 2>&1 & warm=$$!; fi; \
	$(PY) -m pytest $(ARGS); rc=$$?; \
	if [ -n "$$warm" ]; then kill $$warm 2>/dev/null; wait $$warm; grep '^\[warm_caches\]' "$$log"; fi; \
	rm -f "$$log"; exit $$rc

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
