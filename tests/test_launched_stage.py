"""Stages the train task runs over several processes (``accelerate launch``, gloo on the CPU,
``tasks/launch.py``): the same model as one process in the task's own process, rank 0
alone logging into the stage's MLflow run, the launch's output in the task's Prefect logs, resume
from a complete checkpoint to the same weights, a
failed rank's traceback as the task's error, and no process left behind by a failure, by a
SIGKILLed parent, or by cancelling a flow run of a served deployment through the Prefect API.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from helpers import (
    SMOKE,
    cancelled_run_state,
    dask_cluster,
    flow_run_logs,
    launched_pids,
    mlflow_client,
    wait_until_gone,
)
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterId,
    LogFilter,
    LogFilterTaskRunId,
)
from prefect.logging import disable_run_logger
from safetensors.torch import load_file

from infra.core.config import ComputeConfig, TrackingConfig, load_config
from infra.core.ports import free_port
from infra.core.settings import get_settings
from infra.core.stage_io import StageFolder, TrainInputs
from tasks.machine import LaunchFailed
from tasks.mlflow_runs import experiment_id
from tasks.train import train
from trainers.catalog import STAGES
from trainers.runtime.checkpoints import COMPLETE_MARKER, is_complete

REPO = Path(__file__).resolve().parents[1]
FAILS_ON_RANK_1 = """
import os

if os.environ.get("RANK") == "1":
    raise RuntimeError("rank 1 cannot start: the launch must report this line")
"""


def parent_run(name: str) -> str:
    return mlflow_client().create_run(experiment_id("launched-stages"), run_name=name).info.run_id


def dpo_section(**fields):
    section = {
        "max_steps": 3,
        "logging_steps": 1,
        "save_steps": 2,  # a checkpoint, marked complete by the ranks
        "learning_rate": 1e-4,  # see tests/test_ddp.py: Adam turns rounding into lr-sized differences
        "lr_scheduler_type": "constant",
        "seed": 0,
    }
    return STAGES["dpo"].section(**section | fields)


def cpu(processes: int) -> ComputeConfig:
    return ComputeConfig(cpu=True, num_processes=processes, main_process_port=free_port())


@flow
def train_in_a_flow(section, inputs: TrainInputs, parent_run_id: str, name: str, tracking: TrackingConfig):
    return train("dpo", section, inputs, parent_run_id, name, tracking)


@pytest.mark.flow
def test_two_processes_from_the_task_equal_one_process_in_it_and_resume_from_a_checkpoint(handles, prefect_api_url):
    policy, data, by_view = handles
    reference_logps = by_view["pairs"]
    started = time.time()
    tracking = TrackingConfig(keep_checkpoints=True, log_checkpoints="all")
    one = TrainInputs(policy, data, reference_logps, compute=cpu(1))
    two = TrainInputs(policy, data, reference_logps, compute=cpu(2))
    parent = parent_run("two-processes")
    single = train_in_a_flow(dpo_section(per_device_train_batch_size=4), one, parent, "launched-1", tracking)
    state = train_in_a_flow(
        dpo_section(per_device_train_batch_size=2), two, parent, "launched-2", tracking, return_state=True
    )
    double = state.result()

    first, second = (load_file(Path(h.path) / "model.safetensors") for h in (single, double))
    start = load_file(Path(policy.path) / "model.safetensors")
    assert max((first[k] - start[k]).abs().max().item() for k in first) > 2e-4  # it trained
    worst = max((first[k] - second[k]).abs().max().item() for k in first)
    assert worst <= 1e-5, f"largest weight difference {worst}"

    folder = Path(double.path).parent
    assert json.loads((folder / "model.json").read_text())["mlflow_run_id"] == double.mlflow_run_id
    assert is_complete(folder / "checkpoint-2") and (folder / "checkpoint-2" / COMPLETE_MARKER).is_file()
    assert not list(folder.glob(".model.tmp-*"))
    # torch's launcher leaves a log folder per launch in the temp folder: the launch's own, removed
    assert not (StageFolder(path=folder).launch_dir / "tmp-0").exists()
    assert not [p for p in Path(tempfile.gettempdir()).glob("torchelastic_*") if p.stat().st_mtime >= started]

    client = mlflow_client()
    run = client.get_run(double.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["dpo.per_device_train_batch_size"] == "2"
    assert int(run.data.params["model.trainable_parameters"]) > 0  # logged by rank 0
    assert (run.data.tags["alignflow.processes"], run.data.tags["alignflow.machines"]) == ("2", socket.gethostname())
    assert client.get_run(single.mlflow_run_id).data.tags["alignflow.processes"] == "1"
    for key in ("loss", "rewards/accuracies", "num_tokens"):
        steps = [m.step for m in client.get_metric_history(run.info.run_id, key)]
        assert steps == [1, 2, 3], key  # once per step: rank 0 only
    single_loss = [m.value for m in client.get_metric_history(single.mlflow_run_id, "loss")]
    double_loss = [m.value for m in client.get_metric_history(double.mlflow_run_id, "loss")]
    assert double_loss == pytest.approx(single_loss, abs=1e-5)
    logged = [[a.path for a in client.list_artifacts(h.mlflow_run_id, "checkpoints")] for h in (single, double)]
    assert logged[0] == logged[1] and "checkpoints/checkpoint-2" in logged[1]

    logs = flow_run_logs(state.state_details.flow_run_id)
    assert any(line.startswith("dpo on 2 processes: ") and "--multi_gpu" in line for line in logs)
    assert any(line.startswith("dpo 3/3 · loss ") for line in logs)  # the ranks' own output, line by line
    assert any(line.startswith("dpo done: 3 steps") for line in logs)

    # killed after checkpoint-2, as far as the folder shows: the next attempt resumes there, launched again
    shutil.rmtree(folder / "checkpoint-3")
    shutil.rmtree(folder / "model")
    (folder / "model.json").unlink()
    with disable_run_logger():
        section = dpo_section(per_device_train_batch_size=2)
        resumed = train.fn("dpo", section, two, parent, "launched-2", tracking)
    assert resumed.mlflow_run_id == double.mlflow_run_id and Path(resumed.path) == Path(double.path)
    third = load_file(Path(resumed.path) / "model.safetensors")
    worst = max((third[k] - second[k]).abs().max().item() for k in first)
    assert worst <= 1e-6, f"resumed: largest weight difference {worst}"
    run = client.get_run(double.mlflow_run_id)
    assert run.data.tags["alignflow.resumed_from_step"] == "2"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2, 3]  # step 3 not twice


@pytest.mark.slow
def test_a_failing_rank_fails_the_task_with_its_traceback_and_leaves_nothing(handles, tmp_path, monkeypatch):
    policy, data, by_view = handles
    reference_logps = by_view["pairs"]
    (tmp_path / "fails_on_rank_1.py").write_text(textwrap.dedent(FAILS_ON_RANK_1))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    inputs = TrainInputs(policy, data, reference_logps, compute=cpu(2))
    parent = parent_run("failing-rank")
    with disable_run_logger(), pytest.raises(LaunchFailed) as failed:
        train.fn("dpo", dpo_section(), inputs, parent, "launched-fails", TrackingConfig(), ["fails_on_rank_1"])
    message = str(failed.value)
    assert message.startswith("dpo: rank 1 failed (RuntimeError):")
    assert "RuntimeError: rank 1 cannot start: the launch must report this line" in message.splitlines()[-1]
    assert 'fails_on_rank_1.py", line 5' in message
    (folder,) = (get_settings().outputs / "launched-fails").glob("dpo-*")
    assert not (folder / "model.json").exists() and not (folder / "model").exists()
    assert not list(folder.glob(".model.tmp-*"))
    run_id = (folder / "mlflow_run_id").read_text().strip()
    assert mlflow_client().get_run(run_id).info.status == "FAILED"
    assert launched_pids(str(folder)) == []


SLEEPER_PARENT = """
import sys, time
from infra.core.launching import run_process_group
sleeper = "import time; print('ready', flush=True); time.sleep(600)"
command = [sys.executable, "-c", sleeper, "tasks.launched_rank", sys.argv[1]]  # named as a launch is
run_process_group(command, lambda line: print(line, flush=True))
"""


@pytest.mark.slow
def test_a_sigkilled_parent_takes_its_launch_with_it(tmp_path):
    """PR_SET_PDEATHSIG: the launch (in a session of its own) gets SIGTERM when its parent dies."""
    marker = str(tmp_path / "sleeper")
    parent = subprocess.Popen(
        [sys.executable, "-c", SLEEPER_PARENT, marker], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout.readline().strip() == "ready"
    (child,) = set(launched_pids(marker)) - {parent.pid}  # the parent's own command names them too
    assert os.getpgid(child) != os.getpgid(parent.pid)  # its own group: a signal to the parent's group misses it
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    assert wait_until_gone([child], marker, timeout=10) == []


def task_run_logs(flow_run_id, name: str, line: str, timeout: float):
    """The flow run's task run ``name`` once it ended and its logs hold a line starting with ``line``
    (a worker sends its logs in batches), with its log messages."""
    deadline = time.monotonic() + timeout
    while True:
        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            named = [run for run in runs if run.name == name]
            if named and named[0].state.is_final():
                logs = client.read_logs(LogFilter(task_run_id=LogFilterTaskRunId(any_=[named[0].id])))
                messages = [log.message for log in logs]
                if any(message.startswith(line) for message in messages):
                    return named[0], messages
        assert time.monotonic() < deadline, f"task runs: {[(run.name, run.state.type) for run in runs]}"
        time.sleep(1)


@pytest.mark.flow
def test_cancelling_a_flow_run_of_a_served_deployment_kills_every_rank_on_both_machines(served_smoke, state_dir):
    """`alignflow serve` (the session's) runs the flow run; its DPO stage runs on two "machines" of one
    process each, machine 1's part placed on the Dask worker that offers machine 1's resource. Once
    the stage has a checkpoint, the flow run is cancelled through the Prefect API: the runner's
    SIGTERM reaches the flow process, whose train task stops machine 0's launch, and the gang
    stops machine 1's. No launcher or rank is left on either, and the flow run ends Cancelled. Machine
    1's part is a task run of the flow run (the deployment's module-path entrypoint lets the Dask worker
    import the flow), with its rank's output in its own logs, and it ends Failed."""
    from prefect.client.schemas.objects import StateType
    from prefect.deployments import run_deployment
    from prefect.states import Cancelling

    from tasks.placement import machine_resource

    env = os.environ | {"OMP_NUM_THREADS": "1"}
    with dask_cluster(env, [["--resources", f"{machine_resource(1)}=1"]]) as (address, _):
        overrides = [
            "name=launch-cancel",
            "stages=[dpo]",
            "dpo.reference=none",  # no reference pass: the stage is launched at once (test_ddp launches one)
            "dpo.max_steps=500",  # far more than runs before the cancel
            "dpo.save_steps=2",
            "dpo.logging_steps=1",
            "compute.cpu=true",
            "compute.num_processes=2",
            "compute.num_machines=2",
            "compute.main_process_ip=127.0.0.1",
            "compute.join_timeout=60",
            f"compute.main_process_port={free_port()}",
            f"compute.machine_scheduler={address}",
            "tracking.experiment_name=launch-cancel",
        ]
        config = load_config("configs/minimal.yaml", overrides).model_dump(mode="json")
        outputs = state_dir / "outputs" / "launch-cancel"
        flow_run = run_deployment(SMOKE, parameters={"config": config}, timeout=0)
        deadline = time.monotonic() + 400
        while not list(outputs.glob(f"dpo-*/checkpoint-*/{COMPLETE_MARKER}")):
            with get_client(sync_client=True) as client:
                ended = client.read_flow_run(flow_run.id).state.is_final()
            assert time.monotonic() < deadline and served_smoke.poll() is None and not ended, "\n".join(
                ["the launched stage never checkpointed; the flow run's last logs:", *flow_run_logs(flow_run.id)[-30:]]
            )
            time.sleep(0.5)
        pids = launched_pids(str(outputs))
        assert len(pids) == 4, pids  # each machine's launcher and its rank
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(flow_run.id, Cancelling(message="cancelled by the test"))
            # gone before the runner's 30 s grace ends: the task stopped the launch (seen: ~1 s with the
            # runner polling every second), not the runner's SIGKILL of the flow process
            assert wait_until_gone(pids, str(outputs), timeout=25) == []
        final = cancelled_run_state(flow_run.id)
        assert served_smoke.poll() is None  # the runner goes on serving
        assert final.type == StateType.CANCELLED, final
        # machine 0's ranks' output is in the task run's logs (read while the gang is watched)
        assert any(line.startswith("rank 0: running ") for line in flow_run_logs(flow_run.id))
        part, logs = task_run_logs(flow_run.id, "dpo: machine 1", "rank 1: running ", timeout=60)
        assert part.state.type == StateType.FAILED and "LaunchFailed: dpo: " in part.state.message
        assert any(line.startswith("dpo: machine 1 joined; waiting up to 60 s") for line in logs), logs
        assert [line for line in logs if not line.strip() or "Loading weights" in line] == []  # no progress bars
    assert not list(outputs.glob("dpo-*/model.json"))
