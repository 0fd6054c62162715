# Two commands: `make serve` sets up what serving needs and starts the server on the default
# model; `make test` sets up the test extra as well and runs the tests.
#   make serve ARGS="--port 9000"          flags for `tessera serve`
#   make generate PROMPT="..." ARGS="..."  one reply, streamed
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROMPT ?= Tell me about paged attention
ARGS ?=
# The CPU wheel of torch first, pinned, so nothing later can pull a multi-GB CUDA build.
TORCH ?= torch==2.13.0

.PHONY: setup setup-dev generate serve test test-unit lint clean

# The runtime install: torch, then Tessera and its core dependencies (no test or benchmark extras).
$(VENV)/.installed-serve: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e .
	# The C++ kernels, built once for this CPU (a failed build only means the torch fallback).
	$(BIN)/python -m tessera.native || echo "native kernels not built: the torch kernels will be used"
	touch $@

# The test install: the above plus the dev extra (pytest, openai, schemathesis, ray, triton, ...).
$(VENV)/.installed-dev: $(VENV)/.installed-serve
	$(BIN)/pip install -q $(TORCH) -e '.[dev]'
	touch $@

setup: $(VENV)/.installed-serve

setup-dev: $(VENV)/.installed-dev

generate: setup
	$(BIN)/tessera generate "$(PROMPT)" $(ARGS)

serve: setup
	$(BIN)/tessera serve $(ARGS)

test: setup-dev
	$(BIN)/python -m pytest -q $(ARGS)

test-unit: setup-dev
	$(BIN)/python -m pytest -q -m "not integration" $(ARGS)

lint: setup-dev
	$(BIN)/ruff check tessera tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache
