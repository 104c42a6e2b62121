"""Test session setup: an isolated run-state folder, one Prefect test server and one ``alignflow
serve`` for the session, and the tiers.

Every test declares its tier, in its module (``pytestmark = pytest.mark.unit``) or on itself; a test
with none, or with two, is a collection error. The tiers (``pyproject.toml`` describes them too):

- ``unit``: no server, no subprocess, no root (``make test-fast``). Starting a subprocess fails the
  test (``unit_tests_start_no_subprocess``), and so does asking for a fixture that starts a server.
- ``slow``: subprocesses of their own (``accelerate launch`` ranks, ``alignflow`` commands, servers
  started by the test) or training heavy enough to keep out of the quick loop; no session server.
- ``flow``: the session's Prefect server (``prefect_api_url``) or ``alignflow serve`` (``served_smoke``).
- ``services``: PostgreSQL, Chromium and real Prefect/MLflow servers (``make test`` starts them).
- ``vllm``: a real vLLM engine, in the environment of its own that ``make test`` builds for it.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

# Before anything imports prefect or mlflow: every test session gets its own run-state folder.
_STATE = Path(tempfile.mkdtemp(prefix="alignflow-tests-"))
os.environ["ALIGNFLOW_HOME"] = str(_STATE)
os.environ.pop("MLFLOW_TRACKING_URI", None)
os.environ.pop("PREFECT_API_URL", None)

from helpers import migrated_mlflow_database  # noqa: E402

from infra.core.settings import configure_environment  # noqa: E402
from trainers.runtime.fast_exit import end_at_exit_without_teardown  # noqa: E402

configure_environment()  # first: building the template imports MLflow, which would write ~/.config/mlflow otherwise
shutil.copyfile(migrated_mlflow_database(), _STATE / "mlflow.db")  # the session's store, migrated once per version

SESSION: list[pytest.Session] = []  # the session once it ended (pytest_sessionfinish)
# Registered before Prefect, MLflow or torch register theirs, so it runs after them: the session
# ends with pytest's exit status, without the interpreter's teardown (2-3 s here). An xdist worker
# ends as execnet ends it; a run whose session never ended (a usage error) exits as usual.
if "PYTEST_XDIST_WORKER" not in os.environ:
    end_at_exit_without_teardown(lambda: int(SESSION[0].exitstatus) if SESSION else None)

import platform  # noqa: E402

import torch  # noqa: E402

platform.processor()  # runs `uname -p` once, then cached: not in the unit test that first asks (MLflow does)

# Two threads on this project's 2-core machines; OMP_NUM_THREADS=1 when sharing the cores (a suite
# next to other work: more runnable threads than cores make torch's threads spin-wait on each other).
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))


@pytest.fixture(scope="session")
def state_dir() -> Path:
    return _STATE


@pytest.fixture(scope="session")
def prefect_api_url():
    """One Prefect API server for the whole session: a run's temporary server, without its auth
    string, on a copy of the migrated template database in a folder of its own. It answers after
    ~4 CPU s; Prefect's ``prefect_test_harness`` migrates a new database first (~14 CPU s)."""
    from helpers import migrated_prefect_database
    from prefect.logging.handlers import APILogHandler
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from infra.core.ports import free_port
    from infra.ops.prefect_api import TemporaryServer

    home = _STATE / "session-prefect-server"
    home.mkdir()
    shutil.copyfile(migrated_prefect_database(), home / "prefect.db")
    server = TemporaryServer(free_port(), home / "server.log", auth_string=None, home=home)
    server.launch()
    server.wait_ready(timeout=120)
    url = server.api_url
    try:
        with temporary_settings(updates={PREFECT_API_URL: url}):
            yield url
            APILogHandler().flush()  # the session's last flow-run logs reach it before it stops
    finally:
        server.stop()


@pytest.fixture(scope="session")
def tiny():
    """The built-in model and tokenizer (fresh weights, seed 0)."""
    from trainers.models.builtin import build_builtin_model

    return build_builtin_model("builtin:tiny-llama", seed=0)


@pytest.fixture(scope="session")
def tiny_pairs(tiny) -> list[dict]:
    """32 of the built-in task's preference pairs, tokenized for ``tiny`` (prompt, chosen, rejected ids)."""
    from trainers.data.rows import Truncation, tokenize_split
    from trainers.data.synthetic import AdditionTask, generate_addition

    rows = generate_addition(AdditionTask(max_operand=9, num_eval_problems=20))["preference"]
    tokenized, dropped = tokenize_split(rows, "preference", tiny[1], Truncation(32, 16))
    assert dropped == 0
    return tokenized[:32]


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
def teacher_checkpoint(tmp_path_factory):
    """The built-in model with other weights (seed 1) and the same tokenizer, saved as a checkpoint
    folder, as its handle: a distillation teacher."""
    from tasks.models import checkpoint_handle
    from trainers.models.builtin import save_builtin_model

    folder = save_builtin_model("builtin:tiny-llama", 1, tmp_path_factory.mktemp("teacher-checkpoint") / "model")
    return checkpoint_handle(folder, "teacher")


@pytest.fixture(scope="session")
def handles(tiny_checkpoint):
    """A stage's inputs as handles: the tiny model's checkpoint (the policy and the reference), a
    real prepared dataset and a real reference-cache entry for them, by reference view (the pairs; KTO's rows)."""
    from prefect.logging import disable_run_logger

    from infra.core.config import AdditionTaskConfig, DataConfig, ReferenceConfig
    from tasks.data import prepare_dataset
    from tasks.reference import cache_ref_logps

    policy = tiny_checkpoint.model_copy(update={"stage": "sft"})
    with disable_run_logger():
        data = prepare_dataset.fn(DataConfig(builtin=AdditionTaskConfig(max_operand=3, num_eval_problems=4)), policy)
        reference_logps = {
            view: cache_ref_logps.fn(data, policy, ReferenceConfig(batch_size=16), view=view)
            for view in ("pairs", "kto")
        }
    return policy, data, reference_logps


@pytest.fixture(scope="session")
def served_smoke(prefect_api_url, state_dir):
    """One ``alignflow serve --name smoke`` for the session, on its Prefect server and state folder,
    polling for flow runs every second: the served deployment is ``helpers.SMOKE``."""
    from helpers import ALIGNFLOW, PROJECT, SMOKE, wait_for_deployment

    from infra.core.launching import stop_group

    env = {**os.environ, "ALIGNFLOW_HOME": str(state_dir), "PREFECT_API_URL": prefect_api_url, "OMP_NUM_THREADS": "1"}
    env["PREFECT_RUNNER_POLL_FREQUENCY"] = "1"
    server = subprocess.Popen(
        [*ALIGNFLOW, "serve", "--name", "smoke"],
        cwd=PROJECT,
        env=env,
        start_new_session=True,
        stderr=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
    )
    try:
        wait_for_deployment(SMOKE, server)
        yield server
    finally:
        stop_group(server)


TIERS = ("unit", "slow", "flow", "services", "vllm")
SERVER_FIXTURES = ("prefect_api_url", "served_smoke")  # what a unit test may not ask for


def selected_tiers(config) -> set[str] | None:
    """The tiers ``-m`` selects when it is a plain ``a or b`` of tier names (the Makefile's); else None."""
    names = {name.strip() for name in config.option.markexpr.split(" or ")} if config.option.markexpr else set()
    return names if names and names <= set(TIERS) else None


def module_tier(path: Path) -> str | None:
    """The tier a module declares for all its tests (``pytestmark = pytest.mark.<tier>``), read
    without importing it; None for a module whose tests declare their own."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["pytestmark"]:
            tier = ast.unparse(node.value).removeprefix("pytest.mark.")
            return tier if tier in TIERS else None
    return None


def pytest_ignore_collect(collection_path: Path, config):
    """A module of a tier ``-m`` does not select is not even imported: ``make test-fast`` would
    otherwise import every training module of the slow tiers to deselect their tests."""
    tiers = selected_tiers(config)
    if tiers is None or collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    tier = module_tier(collection_path)
    return True if tier is not None and tier not in tiers else None


def pytest_collection_modifyitems(config, items):
    """Each test has exactly one tier marker, declared in its module or on itself (never inferred)."""
    problems, tier_of = [], {}
    for item in items:
        tiers = sorted({mark.name for mark in item.iter_markers() if mark.name in TIERS})
        if len(tiers) != 1:
            problems.append(f"{item.nodeid}: {'tier markers ' + ', '.join(tiers) if tiers else 'no tier marker'}")
        elif tiers == ["unit"] and (servers := [f for f in SERVER_FIXTURES if f in item.fixturenames]):
            problems.append(f"{item.nodeid}: a unit test uses {', '.join(servers)} (a server): mark it flow")
        else:
            (tier_of[item],) = tiers
    if problems:
        raise pytest.UsageError(
            f"every test needs exactly one tier marker of {', '.join(TIERS)} "
            "(pytestmark = pytest.mark.<tier> in its module, or on the test):\n  " + "\n  ".join(problems)
        )
    heaviest_first(items, tier_of)


def heaviest_first(items, tier_of: dict) -> None:
    """Modules in the order of their heaviest tier (services, flow, slow, unit: TIERS backwards), each
    module's tests in their own order. ``make test`` hands whole modules to two workers in this order
    (``--dist loadscope``): the long modules start first and the quick ones fill the ends, and a
    module's fixtures (the kill chain, the sweep grid, the team stack) are built once, on one worker."""
    heaviest: dict[str, int] = {}
    for item, tier in tier_of.items():
        heaviest[item.module.__name__] = max(heaviest.get(item.module.__name__, 0), TIERS.index(tier))
    items.sort(key=lambda item: -heaviest[item.module.__name__])


@pytest.fixture(autouse=True)
def unit_tests_start_no_subprocess(request, monkeypatch):
    """The unit tier's promise, checked: a unit test that starts a subprocess fails, naming it."""
    if request.node.get_closest_marker("unit") is None:
        return

    def refuse(self, args, *rest, **options):
        raise RuntimeError(f"a unit test starts no subprocess, and this one started {args!r}: mark it slow")

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)


def pytest_sessionfinish(session, exitstatus):
    """Remove the session's run-state folder (MLflow store, caches, outputs) unless asked to keep it."""
    SESSION.append(session)
    if not os.environ.get("ALIGNFLOW_KEEP_TEST_STATE"):
        shutil.rmtree(_STATE, ignore_errors=True)
