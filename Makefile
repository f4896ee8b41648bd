# The two entry commands: `make run` (install + the example RL run) and `make test` (install + tests).
PYTHON ?= python3.11
VENV   ?= .venv
BIN     = $(VENV)/bin
CONFIG ?= examples/arithmetic.yaml
RUN_DIR ?= runs/arithmetic

.PHONY: run test install install-test clean

$(BIN)/python:
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) (or run: make PYTHON=python3 ...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch is pinned to the CPU build (2.13.0); a looser pin could pull a multi-GB CUDA build.
install: $(BIN)/python
	$(BIN)/pip install -q -e .

install-test: $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'

run: install
	$(BIN)/tidal run $(CONFIG) --run-dir $(RUN_DIR)

test: install-test
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) runs
