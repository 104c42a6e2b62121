# Two commands: `make run` (default experiment) and `make test` (the whole suite).
# Each creates .venv and installs what it needs on first use.
VENV ?= .venv
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.alignflow-installed
CONFIG ?= configs/default.yaml

.PHONY: install run test clean

install: $(INSTALLED)

$(INSTALLED): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(INSTALLED)

run: $(INSTALLED)
	$(VENV)/bin/alignflow run $(CONFIG) $(ARGS)

test: $(INSTALLED)
	bash infra/with-test-services.sh $(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf .alignflow
