# One command sets up and runs the main job; one sets up and runs the tests.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROMPT ?= Tell me about paged attention

.PHONY: setup generate serve test test-unit lint bench clean

$(BIN)/tessera: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU wheel of torch first, pinned, so nothing later can pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# The C++ kernels, built once for this CPU (a failed build only means the torch fallback).
	$(BIN)/python -m tessera.native || echo "native kernels not built: the torch kernels will be used"
	touch $@

setup: $(BIN)/tessera

generate: setup
	$(BIN)/tessera generate "$(PROMPT)"

serve: setup
	$(BIN)/tessera serve

test: setup
	$(BIN)/python -m pytest -q

test-unit: setup
	$(BIN)/python -m pytest -q -m "not integration"

lint: setup
	$(BIN)/ruff check tessera tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache
