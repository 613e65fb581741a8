# Two entry points for a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: venv demo test lint protos
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

lint: venv
	$(BIN)/ruff check .

protos: venv
	$(BIN)/python protos/generate.py
