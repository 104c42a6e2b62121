# Two commands: `make run` (default experiment) and `make test` (the whole suite: lint, then every
# test tier). `make test-fast` is the quick loop: lint and the unit tier, no server, no subprocess.
# Each creates .venv and installs what it needs on first use.
VENV ?= .venv
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.alignflow-installed
CONFIG ?= configs/default.yaml

.PHONY: install run test test-fast lint clean

# The test runs keep Python's bytecode (in __pycache__/, ignored by git) even where the environment
# says not to write it: without it every run, and every subprocess the suite starts, compiles the
# project and pytest rewrites every test module's assertions anew.
test test-fast: export PYTHONDONTWRITEBYTECODE :=

install: $(INSTALLED)

$(INSTALLED): pyproject.toml
	@echo "install 1/4: virtual environment $(VENV)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "install 2/4: pip"
	@$(PY) -m pip install --quiet --upgrade pip
	@echo "install 3/4: $(TORCH_SPEC) (the largest download when it is not on disk)"
	@$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	@echo "install 4/4: alignflow and its dependencies (pyproject.toml, with the test extras)"
	@$(PY) -m pip install --quiet -e ".[test]"
	@touch $(INSTALLED)

run: $(INSTALLED)
	$(VENV)/bin/alignflow run $(CONFIG) $(ARGS)

lint: $(INSTALLED)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Every tier (tests/conftest.py describes them) in one run on two pytest workers, one torch thread each.
# Whole modules go to a worker (--dist loadscope), heaviest tier first (conftest orders them): a
# module's fixtures are built once, and the flow tiers' waits on servers overlap the other worker's
# training. Each worker has its own state folder and session Prefect server, ports come from
# free_port, and the services tests' databases have names of their own.
test: lint
	OMP_NUM_THREADS=1 bash infra/ops/with-test-services.sh \
		$(PY) -m pytest -n 2 --dist loadscope --no-loadscope-reorder $(PYTEST_ARGS)

# The quick loop: lint and the unit tier (no server, no subprocess, no root) in one process: two
# workers would each import torch, transformers, Prefect and MLflow, which costs more than they save.
test-fast: lint
	$(PY) -m pytest -m unit -p no:xdist $(PYTEST_ARGS)

clean:
	rm -rf .alignflow
