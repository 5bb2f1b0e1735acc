# The two fresh-machine commands of the README: `make run` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup run test
setup: $(BIN)/.installed

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	# torch 2.13.0 is a CPU build available locally; an unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

run: setup
	$(BIN)/python -m scripts.run_demo

test: setup
	$(BIN)/python -m pytest -q tests
