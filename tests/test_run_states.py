"""Honest run states: a real `alignflow run` killed with SIGKILL leaves RUNNING runs behind; `alignflow
runs cleanup` (and the next `alignflow run`) marks them FAILED in MLflow and CRASHED in Prefect with
the reason, and leaves live runs and runs of other hosts alone. And two runs started at once on a
fresh state folder both finish (the first-time database set-up is serialised).

The kill tests' subprocesses use the session's Prefect server (so this test can read its states)
and their own state folder (their own MLflow SQLite store)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from uuid import UUID

import pytest
from helpers import ALIGNFLOW, alignflow, environment_without_services, mlflow_client, state_folder_environment
from helpers import PROJECT as PROJECT_ROOT
from mlflow import MlflowClient
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.states import Running

from infra.core.locks import LocalFileLock, LockTimeout
from infra.core.processes import ProcessRecord, is_alive, process_record, stat_fields
from infra.core.settings import Settings
from infra.ops import databases
from infra.ops.databases import READY_FILE
from infra.ops.runs import REASON_TAG, gone_reason, orphaned_temporary_servers, verdict

SHORT_RUN = ["configs/minimal.yaml", "stages=[sft]", "sft.max_steps=2", "evaluation.num_prompts=4"]
START_TIMEOUT_S = 240


def fresh_state_env(home: Path) -> dict[str, str]:
    """Environment of an `alignflow` subprocess with its own state folder ``home`` (and nothing of
    this session's: its Prefect home, API URL and tracking URI)."""
    return environment_without_services() | {"ALIGNFLOW_HOME": str(home), "OMP_NUM_THREADS": "1"}


@pytest.fixture
def home(tmp_path, prefect_api_url):
    """A subprocess environment: its own state folder, the session's Prefect server."""
    return fresh_state_env(tmp_path / "home") | {"PREFECT_API_URL": prefect_api_url}


def runs_by_name(client: MlflowClient) -> dict[str, object]:
    experiments = [e.experiment_id for e in client.search_experiments()]
    return {run.info.run_name: run for run in client.search_runs(experiments)}


def flow_run_states(flow_run_id: str) -> tuple[object, dict[str, object]]:
    """The flow run's state and its task runs' states by task run name."""
    with get_client(sync_client=True) as prefect:
        run = prefect.read_flow_run(UUID(flow_run_id))
        tasks = prefect.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
    return run, {task.name: task.state for task in tasks}


@flow(name="cleanup-probe")
def probe_flow():
    """Stands for a flow run made by another process (only created through the API, never run)."""


def running_flow_run(record: ProcessRecord) -> str:
    """A RUNNING Prefect flow run labelled with ``record``, as `alignflow run` labels its own."""
    with get_client(sync_client=True) as prefect:
        run = prefect.create_flow_run(probe_flow, state=Running())
        prefect.update_flow_run_labels(run.id, record.tags())
    return str(run.id)


def running_mlflow_runs(client: MlflowClient, name: str, record: ProcessRecord | None) -> tuple[str, str]:
    """A RUNNING parent run with ``record`` and a RUNNING child without one (judged by its parent's)."""
    experiment = client.get_experiment_by_name("probes") or client.get_experiment(client.create_experiment("probes"))
    parent = client.create_run(experiment.experiment_id, run_name=name, tags=record.tags() if record else {})
    child = client.create_run(
        experiment.experiment_id, run_name=f"{name}-child", tags={"mlflow.parentRunId": parent.info.run_id}
    )
    return parent.info.run_id, child.info.run_id


def dead_process_record() -> ProcessRecord:
    """The record of a real process that has exited since."""
    sleeper = subprocess.Popen(["sleep", "30"])
    record = process_record(sleeper.pid)
    sleeper.kill()
    sleeper.wait()
    return record


def wait_for_line(log: Path, needle: str, runner: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while needle not in log.read_text():
        assert runner.poll() is None, f"the run ended early:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {needle!r} after {START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.5)


def kill_while_training(env: dict, log: Path, step: int) -> tuple[subprocess.Popen, ProcessRecord]:
    """Start a long SFT run, SIGKILL it once it has trained ``step`` steps (no handler, no atexit, no
    ``finally`` of the run gets to run); returns the reaped process and its record from before."""
    with log.open("w") as out:
        runner = subprocess.Popen(
            [*ALIGNFLOW, "run", "configs/minimal.yaml", "stages=[sft]", "sft.max_steps=100000"],
            cwd=PROJECT_ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for_line(log, f"sft {step}/100000", runner)
        return runner, process_record(runner.pid)
    finally:
        runner.kill()
        runner.wait()


def task_name(name: str) -> str:
    """``resolve-model-4bd`` → ``resolve-model`` (Prefect appends a short key); ``train-sft`` as it is."""
    return name if name.startswith("train-") else name.rsplit("-", 1)[0]


def status(client: MlflowClient, run_id: str) -> tuple[str, str | None]:
    run = client.get_run(run_id)
    return run.info.status, run.data.tags.get(REASON_TAG)


@pytest.mark.flow
def test_a_killed_run_is_marked_failed_and_crashed_and_live_runs_are_left_alone(home, tmp_path):
    runner, killed = kill_while_training(home, tmp_path / "run.log", step=4)  # metrics logged by then
    client = mlflow_client(home["ALIGNFLOW_HOME"])
    killed_runs = runs_by_name(client)
    parent, stage = killed_runs["minimal"], killed_runs["sft"]
    assert (parent.info.status, stage.info.status) == ("RUNNING", "RUNNING")  # what the kill left behind
    assert ProcessRecord.from_tags(parent.data.tags) == killed == ProcessRecord.from_tags(stage.data.tags)
    flow_run_id = parent.data.tags["prefect.flow_run_id"]

    live = process_record()  # this test process
    live_parent, live_child = running_mlflow_runs(client, "live", live)
    elsewhere = replace(live, host=f"not-{socket.gethostname()}")
    other_parent, other_child = running_mlflow_runs(client, "elsewhere", elsewhere)
    live_flow_run, other_flow_run = running_flow_run(live), running_flow_run(elsewhere)

    dry = alignflow(home, "runs", "cleanup", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    lines = dry.stdout.splitlines()
    for line in (
        f"would mark FAILED: MLflow run minimal ({parent.info.run_id}): {killed}",
        f"would mark FAILED: MLflow run sft ({stage.info.run_id}): {killed}",
        f"left alone: MLflow run elsewhere ({other_parent}): runs on host {elsewhere.host}; "
        "its process can only be checked there",
        f"left alone: Prefect flow run {flow_run_states(other_flow_run)[0].name} ({other_flow_run}): "
        f"runs on host {elsewhere.host}; its process can only be checked there",
    ):
        assert line in lines, dry.stdout
    assert any(line.startswith("would mark CRASHED: Prefect flow run ") and flow_run_id in line for line in lines)
    assert status(client, parent.info.run_id) == ("RUNNING", None)  # a dry run changes nothing
    assert flow_run_states(flow_run_id)[0].state.type.value == "RUNNING"

    done = alignflow(home, "runs", "cleanup")
    assert done.returncode == 0, done.stderr
    reason = gone_reason(killed)
    assert reason == (
        f"process gone: pid {runner.pid} on {socket.gethostname()} (started at tick {killed.start_ticks}) "
        "no longer runs (found by alignflow runs cleanup)"
    )
    assert status(client, parent.info.run_id) == ("FAILED", reason)
    assert status(client, stage.info.run_id) == ("FAILED", reason)
    for run_id in (live_parent, live_child, other_parent, other_child):
        assert status(client, run_id) == ("RUNNING", None)

    crashed, tasks = flow_run_states(flow_run_id)
    assert (crashed.state.type.value, crashed.state.message, crashed.labels[REASON_TAG]) == ("CRASHED", reason, reason)
    assert {
        task_name(name): (state.type.value, state.message if state.is_crashed() else None)
        for name, state in tasks.items()
    } == {
        "resolve-model": ("COMPLETED", None),
        "prepare-dataset": ("COMPLETED", None),
        "train-sft": ("CRASHED", reason),
    }
    for live_id in (live_flow_run, other_flow_run):
        assert flow_run_states(live_id)[0].state.type.value == "RUNNING"

    again = alignflow(home, "runs", "cleanup")
    assert "0 run(s) whose process is gone" in again.stdout.splitlines()[-1]


@pytest.mark.flow
def test_the_next_alignflow_run_marks_runs_of_dead_processes_first(home, tmp_path):
    dead = dead_process_record()
    client = mlflow_client(home["ALIGNFLOW_HOME"])
    from infra.ops.databases import create_mlflow_store

    create_mlflow_store(client.tracking_uri)
    parent, child = running_mlflow_runs(client, "dead", dead)
    dead_flow_run = running_flow_run(dead)

    result = alignflow(home, "run", *SHORT_RUN)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"alignflow: marked FAILED: MLflow run dead ({parent}): {dead}" in result.stderr.splitlines()
    assert f"alignflow: marked FAILED: MLflow run dead-child ({child}): {dead}" in result.stderr.splitlines()
    reason = f"process gone: {dead} no longer runs (found by alignflow runs cleanup)"
    assert (status(client, parent), status(client, child)) == (("FAILED", reason),) * 2
    crashed, _ = flow_run_states(dead_flow_run)
    assert (crashed.state.type.value, crashed.state.message) == ("CRASHED", reason)
    new_runs = runs_by_name(client)
    assert (new_runs["minimal"].info.status, new_runs["sft"].info.status) == ("FINISHED", "FINISHED")
    assert REASON_TAG not in new_runs["minimal"].data.tags


@pytest.mark.slow
def test_a_reused_pid_a_zombie_and_another_boot_are_not_the_recorded_process():
    me = process_record()
    assert me.pid == os.getpid() and is_alive(me)
    assert not is_alive(replace(me, start_ticks=me.start_ticks + 1))  # same pid, a later process
    assert not is_alive(replace(me, boot_id="another-boot"))
    exited = subprocess.Popen(["true"])
    record = process_record(exited.pid)
    while (stat_fields(exited.pid) or ["Z"])[0] != "Z":  # exited, not yet reaped: a zombie
        time.sleep(0.01)
    assert not is_alive(record)
    exited.wait()
    assert not is_alive(record) and stat_fields(exited.pid) is None


@pytest.mark.slow
def test_runs_are_judged_by_their_record_and_only_on_their_host():
    me = process_record()
    assert ProcessRecord.from_tags(me.tags()) == me
    assert ProcessRecord.from_tags({**me.tags(), "alignflow.process.pid": "x"}) is None
    assert (verdict(me), verdict(None), verdict(dead_process_record())) == ("alive", "unrecorded", "gone")
    assert verdict(replace(me, host="elsewhere", pid=1)) == "other-host"  # pid 1 lives here, which says nothing


RACE_SYMPTOMS = ("duplicate column name", "already exists", "Traceback")


@pytest.mark.slow
def test_two_runs_started_at_once_on_a_fresh_state_folder_both_finish(tmp_path):
    env = fresh_state_env(tmp_path / "home")
    runners = [
        subprocess.Popen(
            [*ALIGNFLOW, "run", *SHORT_RUN], cwd=PROJECT_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        for _ in range(2)
    ]
    outputs = [runner.communicate(timeout=600)[0].decode() for runner in runners]
    for runner, output in zip(runners, outputs):
        assert runner.returncode == 0, output[-3000:]
        assert not [symptom for symptom in RACE_SYMPTOMS if symptom in output], output[-3000:]
    client = mlflow_client(env["ALIGNFLOW_HOME"])
    runs = client.search_runs([client.get_experiment_by_name("alignflow").experiment_id])
    parents = [run.info.run_name for run in runs if "mlflow.parentRunId" not in run.data.tags]
    assert parents == ["minimal", "minimal"] and {run.info.status for run in runs} == {"FINISHED"}
    ready = json.loads((tmp_path / "home" / READY_FILE).read_text())
    assert ready == {"mlflow": importlib.metadata.version("mlflow"), "prefect": importlib.metadata.version("prefect")}


@pytest.mark.slow
def test_a_ready_state_folder_skips_the_set_up_lock_and_a_fresh_one_waits_for_it(tmp_path, monkeypatch):
    settings = Settings(home=tmp_path / "home")
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # a Prefect server: no local Prefect database
    monkeypatch.delenv("MLFLOW_TRACKING_URI")  # the state folder's own SQLite store
    monkeypatch.setattr(databases, "LOCK_TIMEOUT_S", 0.5)
    with LocalFileLock(settings.root / databases.LOCK_FILE, timeout=1):  # another process setting up
        with pytest.raises(LockTimeout, match="databases.lock: still locked after 0 s"):
            databases.prepare_databases(settings)
        assert not (settings.root / "mlflow.db").exists()
    databases.prepare_databases(settings)
    assert (settings.root / "mlflow.db").exists()
    assert json.loads((settings.root / READY_FILE).read_text()) == {"mlflow": importlib.metadata.version("mlflow")}
    with LocalFileLock(settings.root / databases.LOCK_FILE, timeout=1):
        databases.prepare_databases(settings)  # ready: returns without waiting for the lock


@pytest.mark.slow
def test_a_killed_run_on_the_temporary_server_leaves_no_server_and_cleanup_marks_it(tmp_path):
    env = state_folder_environment(tmp_path / "home") | {"OMP_NUM_THREADS": "1"}
    prefect_home = str((tmp_path / "home").resolve() / "prefect")
    try:
        _, killed = kill_while_training(env, tmp_path / "run.log", step=2)
        deadline = time.monotonic() + 30  # the server gets SIGTERM when the run dies (PR_SET_PDEATHSIG)
        while orphaned_temporary_servers(prefect_home) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert orphaned_temporary_servers(prefect_home) == []
        done = alignflow(env, "runs", "cleanup")
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert sum(line.startswith("marked FAILED: MLflow run ") and line.endswith(str(killed)) for line in lines) == 2
        (crashed,) = [line for line in lines if line.startswith("marked CRASHED: Prefect flow run ")]
        assert crashed.endswith(f"with 1 running task run(s): {killed}")
    finally:
        for pid in orphaned_temporary_servers(prefect_home):
            os.kill(pid, signal.SIGKILL)


# A process that looks like Prefect's own temporary server to cleanup (its app in argv, the
# ephemeral flag and this PREFECT_HOME in its environment), left by a parent that exits at once.
ORPHAN = """
import os, subprocess, sys
server = subprocess.Popen(
    [sys.executable, "-c", "import time; time.sleep(600)", "prefect.server.api.server:create_app"],
    env={**os.environ, "PREFECT__SERVER_EPHEMERAL": "1"}, start_new_session=True,
    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
)
print(server.pid)
"""


@pytest.mark.slow
def test_cleanup_stops_a_temporary_server_whose_process_is_gone(tmp_path):
    """A temporary server that outlived its process (Prefect's own, started without a parent-death
    signal) is found by its environment and stopped; on a state folder with no Prefect database,
    cleanup starts no temporary server of its own to look for flow runs."""
    env = fresh_state_env(tmp_path / "home")
    prefect_home = str((tmp_path / "home").resolve() / "prefect")
    env["PREFECT_HOME"] = prefect_home
    starter = subprocess.run([sys.executable, "-c", ORPHAN], env=env, capture_output=True, text=True, check=True)
    orphan = int(starter.stdout)
    try:
        deadline = time.monotonic() + 10
        while orphaned_temporary_servers(prefect_home) != [orphan] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert orphaned_temporary_servers(prefect_home) == [orphan]  # its parent exited: init adopted it
        done = alignflow(env, "runs", "cleanup")
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert lines[0] == f"no Prefect database yet ({prefect_home}/prefect.db): no flow runs to judge"
        assert f"stopped the temporary Prefect server of a killed run: pid {orphan}" in lines
        assert not Path(prefect_home, "prefect.db").exists()  # cleanup started no temporary server of its own
        deadline = time.monotonic() + 30
        while stat_fields(orphan) is not None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert orphaned_temporary_servers(prefect_home) == []
    finally:
        for pid in orphaned_temporary_servers(prefect_home):
            os.kill(pid, signal.SIGKILL)
