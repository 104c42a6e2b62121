"""Test session setup: an isolated run-state folder, one Prefect test server for the session, and
the tiers: ``services`` (PostgreSQL, Chromium, real servers: marked in their modules), ``flow``
(needs the session's Prefect server: every test that uses ``prefect_api_url``, directly or through
a fixture) and ``unit`` (everything else: no server, no root)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

# Before anything imports prefect or mlflow: every test session gets its own run-state folder.
_STATE = Path(tempfile.mkdtemp(prefix="alignflow-tests-"))
os.environ["ALIGNFLOW_HOME"] = str(_STATE)
os.environ.pop("MLFLOW_TRACKING_URI", None)
os.environ.pop("PREFECT_API_URL", None)

from infra.core.settings import configure_environment  # noqa: E402

configure_environment()

import torch  # noqa: E402

# Two threads on this project's 2-core machines; OMP_NUM_THREADS=1 when sharing the cores (a suite
# next to other work: more runnable threads than cores make torch's threads spin-wait on each other).
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))


@pytest.fixture(scope="session")
def state_dir() -> Path:
    return _STATE


@pytest.fixture(scope="session")
def prefect_api_url():
    """One temporary Prefect API server for the whole session (starting one costs ~10 s)."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield PREFECT_API_URL.value()


@pytest.fixture(scope="session")
def tiny():
    """The built-in model and tokenizer (fresh weights, seed 0)."""
    from trainers.builtin_model import build_builtin_model

    return build_builtin_model("builtin:tiny-llama", seed=0)


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny, tmp_path_factory):
    """The built-in model saved as a checkpoint folder, as its handle."""
    from tasks.models import checkpoint_handle

    model, tokenizer = tiny
    folder = tmp_path_factory.mktemp("tiny-checkpoint") / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return checkpoint_handle(folder, "base")


@pytest.fixture(scope="session")
def handles(tiny_checkpoint):
    """A stage's inputs as handles: the tiny model's checkpoint (the policy and the reference), a
    real prepared dataset and a real reference-cache entry for them."""
    from prefect.logging import disable_run_logger

    from infra.core.config import AdditionTaskConfig, DataConfig, ReferenceConfig
    from tasks.data import prepare_dataset
    from tasks.reference import cache_ref_logps

    policy = tiny_checkpoint.model_copy(update={"stage": "sft"})
    with disable_run_logger():
        data = prepare_dataset.fn(DataConfig(builtin=AdditionTaskConfig(max_operand=3, num_eval_problems=4)), policy)
        reference_logps = cache_ref_logps.fn(data, policy, ReferenceConfig(batch_size=16))
    return policy, data, reference_logps


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("services") is None:
            item.add_marker(pytest.mark.flow if "prefect_api_url" in item.fixturenames else pytest.mark.unit)


def pytest_sessionfinish(session, exitstatus):
    """Remove the session's run-state folder (MLflow store, caches, outputs) unless asked to keep it."""
    if not os.environ.get("ALIGNFLOW_KEEP_TEST_STATE"):
        shutil.rmtree(_STATE, ignore_errors=True)
