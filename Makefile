# Two entry points for a fresh machine: `make demo` and `make test`; `make test-fast` while editing.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: venv demo test test-fast lint protos
venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

demo: venv
	$(BIN)/gorgo demo

test: venv
	$(BIN)/ruff check .
	$(BIN)/python protos/generate.py --check
	$(BIN)/python -m pytest -q

# The same checks without the tests that start a real Envoy or run for more than a few seconds.
test-fast: venv
	$(BIN)/ruff check .
	$(BIN)/python protos/generate.py --check
	$(BIN)/python -m pytest -q -m "not envoy and not slow"

lint: venv
	$(BIN)/ruff check .

protos: venv
	$(BIN)/python protos/generate.py
