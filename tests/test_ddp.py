"""Multi-process training on the CPU: real ``accelerate launch`` subprocesses (gloo), each run
asserting its own world size, compared with one process doing the same work.

DPO: 2 processes × 2 pairs equal 1 process × 4 pairs (logged loss trajectory, global metrics,
final weights). GRPO: 2 processes equal 1 process with completions seeded per row
(``generation_seed``), one group spread over both ranks, so that its advantages need the rewards
of both, and a KL term to a live reference. Each rank runs one torch thread.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import datasets
import pytest
import torch
from helpers import assert_suites_as_one_process, choice_task, dask_cluster, gone_within, processes_naming
from safetensors.torch import load_file

from infra.core.config import AdditionTaskConfig, ComputeConfig, EvaluationConfig
from infra.core.handles import ModelHandle, PreparedData, ReferenceLogps
from infra.core.ports import free_port
from infra.core.settings import get_settings
from infra.core.stage_io import TrainInputs
from tasks import launched_rank
from tasks.launch import launch, untracked_train_job
from tasks.machine import RANK_MODULE, LaunchFailed, machine_runner
from tasks.models import checkpoint_handle
from tasks.placement import machine_resource
from trainers.data.rows import Truncation, tokenize_split
from trainers.data.synthetic import AdditionTask, generate_addition
from trainers.models.pretrained import load_causal_lm
from trainers.scoring.reference_pass import reference_logps

REPO = Path(__file__).resolve().parents[1]
# A reward with spread on an untrained model, unscored (None) for some rows: missing rewards cross ranks too.
REWARD_PLUGIN = """
def first_code_point(prompts, completions, **columns):
    return [None if not c else float(ord(c[0]) % 5) for c in completions]
"""
# A plugin that fails on rank 1 only, as the rank reads its spec: before the rendezvous, so rank 0
# waits for it there (no collective whose peer died tells it) until the launch is stopped.
FAILING_REWARD_PLUGIN = """
import os

if os.environ.get("RANK") == "1":
    raise ConnectionError("the reward server cannot be reached from rank 1")

def constant(prompts, completions, **columns):
    return [0.0 for _ in completions]
"""

# A reference view a plugin registers: the pairs with chosen and rejected swapped. The ranks of a
# launched pass know it only from the plugin.
VIEW_PLUGIN = """
import dataclasses

from trainers.scoring.reference_views import PAIRS_VIEW, register_view

register_view(dataclasses.replace(PAIRS_VIEW, name="swapped_pairs", completions=("rejected_ids", "chosen_ids")))
"""


def cpu(processes: int) -> ComputeConfig:
    return ComputeConfig(cpu=True, num_processes=processes, main_process_port=free_port())


def run(job, folder: Path, lines: list[str] | None = None):
    """Run the typed job under ``accelerate launch`` (the pipeline's parent side); rank 0's result."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in {
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(folder),
            "TOKENIZERS_PARALLELISM": "false",
        }.items():
            patch.setenv(name, value)
        lines = [] if lines is None else lines
        result = launch(job, job.job, lines.append)
    assert result.world_size == job.world_size
    # DDP searches for unused parameters only in a model that may leave some out (trainers.models.devices.ddp_arguments)
    assert not [line for line in lines if "find_unused_parameters=True" in line]
    return result


def train(workdir, stage: str, section: dict, processes: int, name: str, plugins: tuple[str, ...] = ()):
    """The stage trained over ``processes`` launched ranks; one process trains here, as the pipeline
    trains a stage of one process (a launch would only add its start-up)."""
    spec, folder = workdir
    inputs = TrainInputs(spec["policy"], spec["data"], compute=cpu(processes))
    job = untracked_train_job(stage, section, inputs, folder / name, plugins)
    if processes == 1:
        with one_torch_thread():
            return launched_rank.train(job).model_dump()
    return run(job, folder).model_dump()


def two_machines(join_timeout: int = 60) -> ComputeConfig:
    """Two "machines" of one CPU process each, both on this host."""
    return ComputeConfig(
        cpu=True,
        num_processes=2,
        num_machines=2,
        main_process_ip="127.0.0.1",
        main_process_port=free_port(),
        join_timeout=join_timeout,
    )


@dataclass
class MachineOne:
    """Machine 1's part of a launch, started as its worker would start it once machine 0 wrote the spec."""

    spec_file: Path
    folder: Path
    log: Path
    process: subprocess.Popen | None = None

    def start_when_ready(self) -> threading.Thread:
        def start() -> None:
            deadline = time.monotonic() + 60
            while not self.spec_file.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(self.folder)}
            command = machine_runner(self.spec_file, 1)
            with self.log.open("w") as output:
                self.process = subprocess.Popen(command, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT)

        starter = threading.Thread(target=start, daemon=True)
        starter.start()
        return starter

    def finish(self) -> tuple[int, str]:
        self.process.wait(timeout=120)
        return self.process.returncode, self.log.read_text()


def train_on_two_machines(workdir, stage: str, section: dict, name: str, plugins: tuple[str, ...] = ()):
    """``train`` over :func:`two_machines`: machine 0's part is the pipeline's launch, here; machine 1's
    is ``python -m tasks.machine`` (what machine 0 logs for it). Machine 0's result (or its error),
    machine 1's exit status and output, and the job."""
    spec, folder = workdir
    job = untracked_train_job(
        stage, section, TrainInputs(spec["policy"], spec["data"], compute=two_machines()), folder / name, plugins
    )
    machine_one = MachineOne(job.spec_file, folder, folder / f"{name}-machine-1.log")
    starter = machine_one.start_when_ready()
    try:
        result = run(job, folder).model_dump()
    except LaunchFailed as error:
        result = error
    starter.join()
    return result, *machine_one.finish(), job


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model" / "model.safetensors")


def train_logs(history: dict) -> list[dict]:
    return [entry for entry in history["log_history"] if "loss" in entry]


def largest_difference(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> float:
    assert first.keys() == second.keys()
    return max((first[name] - second[name]).abs().max().item() for name in first)


def assert_same_weights(one: Path, two: Path, start: str, tolerance: float) -> None:
    """Both runs end at the same weights, and those moved from ``start``'s far more than the tolerance."""
    initial = load_file(Path(start) / "model.safetensors")
    assert largest_difference(weights(one), initial) > 20 * tolerance
    worst = largest_difference(weights(one), weights(two))
    assert worst <= tolerance, f"largest weight difference {worst}"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny_checkpoint, tiny):
    """The tiny checkpoint, DPO pairs with their reference log-probs and GRPO prompts, on disk."""
    folder = tmp_path_factory.mktemp("ddp")
    model, tokenizer = load_causal_lm(tiny_checkpoint.path)
    rows = generate_addition(AdditionTask(max_operand=9, num_eval_problems=20))
    pairs, _ = tokenize_split(rows["preference"][:16], "preference", tokenizer, Truncation(32, 16))
    chosen, rejected = reference_logps(model, tokenizer.pad_token_id, pairs, batch_size=16, progress=False)
    pairs = [dict(r, ref_chosen_logps=c, ref_rejected_logps=j) for r, c, j in zip(pairs, chosen, rejected)]
    prompts, _ = tokenize_split(rows["grpo_prompts"][:8], "grpo_prompts", tokenizer, Truncation(32, 16))
    splits = datasets.DatasetDict(
        {"preference": datasets.Dataset.from_list(pairs), "grpo_prompts": datasets.Dataset.from_list(prompts)}
    )
    splits.save_to_disk(folder / "splits")
    (folder / "ddp_rewards.py").write_text(textwrap.dedent(REWARD_PLUGIN))
    (folder / "ddp_failing_rewards.py").write_text(textwrap.dedent(FAILING_REWARD_PLUGIN))
    data = PreparedData(
        path=str(folder / "splits"), fingerprint="ddp", rows={}, dropped={}, token_fingerprints={}, truncation={}
    )
    policy = checkpoint_handle(Path(tiny_checkpoint.path), "init")
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(folder))  # the reward plugin, importable here as in the ranks
        yield {"model": tiny_checkpoint.path, "splits": folder / "splits", "policy": policy, "data": data}, folder


@pytest.mark.slow
def test_a_launch_that_runs_fewer_processes_than_asked_fails(workdir):
    spec, folder = workdir
    dpo = {"per_device_train_batch_size": 4, "max_steps": 1, "eval_strategy": "no"}
    inputs = TrainInputs(spec["policy"], spec["data"], compute=cpu(2))
    job = untracked_train_job("dpo", dpo, inputs, folder / "short")
    job.launch_dir.mkdir(parents=True)
    job.spec_file.write_text(job.model_dump_json())
    command = ComputeConfig(cpu=True).launch_command(job.spec_file, RANK_MODULE)  # one process
    done = subprocess.run(command, cwd=REPO, env=os.environ | {"OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    assert done.returncode != 0
    assert "the spec asks for 2 processes, this run has 1" in done.stderr
    assert not (folder / "short" / "model").exists()


@pytest.mark.slow
def test_dpo_on_two_processes_of_two_pairs_equals_one_process_of_four(workdir):
    spec, folder = workdir
    section = {
        "num_train_epochs": 1,  # 16 pairs: 4 steps of 4 pairs
        # Adam turns rounding in near-zero gradients into differences of up to lr per step: ~1e-5 at 1e-3
        "learning_rate": 1e-4,
        "lr_scheduler_type": "constant",
        "logging_steps": 1,
        "eval_strategy": "no",
        "seed": 0,
    }
    one = train(workdir, "dpo", section | {"per_device_train_batch_size": 4}, 1, "dpo1")
    two = train(workdir, "dpo", section | {"per_device_train_batch_size": 2}, 2, "dpo2")
    one_logs, two_logs = train_logs(one), train_logs(two)
    assert [entry["step"] for entry in one_logs] == [entry["step"] for entry in two_logs] == [1, 2, 3, 4]
    for single, double in zip(one_logs, two_logs):
        for metric in ("loss", "rewards/accuracies", "rewards/margins", "logps/chosen", "num_tokens"):
            assert double[metric] == pytest.approx(single[metric], abs=1e-5), metric
    # num_tokens is summed over the ranks: the global batch's tokens, 4 pairs × 2 rows each
    assert one_logs[0]["num_tokens"] == two_logs[0]["num_tokens"] > 0
    assert one_logs[0]["loss"] != one_logs[-1]["loss"]  # it trained
    assert_same_weights(folder / "dpo1", folder / "dpo2", spec["model"], 1e-5)
    # two machines of one process each: the same ranks, the same result; machine 1's part placed on
    # the Dask worker that offers machine 1's resource (started by hand, its command: the GRPO test's
    # two machines and the killed machine below)
    two_section = section | {"per_device_train_batch_size": 2}
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    with dask_cluster(env, [["--resources", f"{machine_resource(1)}=1"]]) as (address, _):
        compute = two_machines().model_copy(update={"machine_scheduler": address})
        job = untracked_train_job(
            "dpo", two_section, TrainInputs(spec["policy"], spec["data"], compute=compute), folder / "dpo2d"
        )
        lines: list[str] = []
        on_dask = run(job, folder, lines).model_dump()
    assert any("train: machine 1's part submitted to the Dask worker with alignflow-machine-1" in ln for ln in lines)
    assert any(line.startswith("train: machine 1's part exited with 0; its last lines:") for line in lines)
    assert on_dask["world_size"] == 2 and train_logs(on_dask) == two_logs
    assert largest_difference(weights(folder / "dpo2"), weights(folder / "dpo2d")) == 0.0


@pytest.mark.slow
def test_grpo_on_two_processes_equals_one_process_with_a_group_across_ranks(workdir):
    spec, folder = workdir
    section = {
        "max_steps": 3,
        "num_generations": 4,
        "generation_batch_size": 4,  # one prompt per step: its group of 4 is split 2 + 2 over the ranks
        "learning_rate": 1e-2,
        "lr_scheduler_type": "constant",
        "logging_steps": 1,
        "generation_seed": 7,
        "max_completion_length": 4,
        "log_completions_steps": 0,
        "reward_funcs": ["ddp_rewards:first_code_point"],
        "beta": 0.05,  # a KL term to a frozen reference copy, prepared on every rank
        "seed": 0,
    }
    plugins = ("ddp_rewards",)
    one = train(workdir, "grpo", section | {"per_device_train_batch_size": 4}, 1, "grpo1", plugins)
    two = train(workdir, "grpo", section | {"per_device_train_batch_size": 2}, 2, "grpo2", plugins)
    one_logs, two_logs = train_logs(one), train_logs(two)
    assert len(one_logs) == len(two_logs) == 3
    for single, double in zip(one_logs, two_logs):
        for metric in ("loss", "reward", "reward_std", "frac_reward_missing", "completions/mean_length", "kl"):
            assert double[metric] == pytest.approx(single[metric], abs=1e-4), metric
    assert any(entry["reward_std"] > 0 for entry in one_logs)  # advantages were not all 0: it learned something
    assert one_logs[-1]["kl"] > 0  # the policy moved away from its reference
    assert_same_weights(folder / "grpo1", folder / "grpo2", spec["model"], 1e-4)
    # two machines of one process each (machine 1 by hand): the same ranks, the same result
    two_section = section | {"per_device_train_batch_size": 2}
    machines, returncode, output = train_on_two_machines(workdir, "grpo", two_section, "grpo2m", plugins)[:3]
    assert returncode == 0, output
    untimed = [
        [{k: v for k, v in e.items() if not k.startswith("time/")} for e in logs]
        for logs in (two_logs, train_logs(machines))
    ]
    assert untimed[1] == untimed[0]
    assert largest_difference(weights(folder / "grpo2"), weights(folder / "grpo2m")) == 0.0


@pytest.mark.slow
def test_a_machine_that_never_joins_fails_the_launch_naming_it_and_no_rank_starts(workdir):
    spec, folder = workdir
    inputs = TrainInputs(spec["policy"], spec["data"], compute=two_machines(join_timeout=3))
    job = untracked_train_job("sft", {"max_steps": 1}, inputs, folder / "alone")
    lines: list[str] = []
    started = time.monotonic()
    with pytest.raises(LaunchFailed, match=r"sft: machine 1 did not join within 3 s \(compute.join_timeout\)"):
        launch(job, "sft", lines.append)
    assert time.monotonic() - started < 3 + 5
    assert f"sft: machine 1 must run: cd {REPO} && ALIGNFLOW_HOME=" in lines[0]
    assert not [line for line in lines if "sft on 2 processes" in line]  # no accelerate launch anywhere
    assert (
        job.launch_dir / "machine-0.failed"
    ).read_text() == "machine 1 did not join within 3 s (compute.join_timeout)"
    assert processes_naming(str(job.launch_dir)) == []


@pytest.mark.slow
def test_a_part_that_fails_on_its_dask_worker_before_joining_fails_the_wait_at_once(workdir):
    """Machine 1's part placed on Dask fails before it joins (here: its spec is not on that machine's
    storage): machine 0 stops waiting at once, with the part's error, not at the join timeout."""
    from distributed import LocalCluster
    from prefect import task

    from infra.core.gang import Gang, GangError
    from tasks.placement import OnDask

    @task
    def unreadable_spec(spec_file: str, machine: int, name: str):
        raise FileNotFoundError(f"{spec_file} (the shared storage is not mounted here)")

    spec, folder = workdir
    inputs = TrainInputs(spec["policy"], spec["data"], compute=two_machines())
    job = untracked_train_job("dpo", {"max_steps": 1}, inputs, folder / "lost")
    lines: list[str] = []
    resources = {machine_resource(1): 1}
    scratch = str(folder)  # the worker's and the scheduler's dask-scratch-space, not /tmp's
    with LocalCluster(
        n_workers=1,
        processes=False,
        resources=resources,
        dashboard_address=":0",
        local_directory=scratch,
        scheduler_kwargs={"local_directory": scratch},
    ) as cluster:
        placement = OnDask(cluster.scheduler_address, "dpo", lines.append, unreadable_spec, [1])
        placement.place(job, 1)
        gang = Gang(job.launch_dir, 2, 0, join_timeout=60)
        started = time.monotonic()
        with pytest.raises(GangError) as failed:
            gang.wait_for_all(placement.lost)
        assert time.monotonic() - started < 10
        placement.release(gang.joined)
    assert str(failed.value) == (
        f"machine 1's part failed on its Dask worker: FileNotFoundError: {job.spec_file} "
        "(the shared storage is not mounted here)"
    )
    assert lines[-1].startswith("dpo: machine 1's part failed on its Dask worker before it joined: FileNotFoundError")


@pytest.mark.slow
def test_a_machine_whose_resource_no_dask_worker_offers_fails_the_launch_at_once_naming_its_worker_command(tmp_path):
    """The scheduler's only worker offers another machine's resource: machine 1's part would wait for
    a worker until the join timeout (300 s). The launch fails before it writes or submits anything."""
    from distributed import LocalCluster

    policy = ModelHandle(path=str(tmp_path / "sft"), fingerprint="f", tokenizer_fingerprint="t", stage="sft")
    data = PreparedData(
        path=str(tmp_path / "data"), fingerprint="d", rows={}, dropped={}, token_fingerprints={}, truncation={}
    )
    scratch = str(tmp_path)  # the worker's and the scheduler's dask-scratch-space, not /tmp's
    with LocalCluster(
        n_workers=1,
        processes=False,
        resources={machine_resource(2): 1},
        dashboard_address=":0",
        local_directory=scratch,
        scheduler_kwargs={"local_directory": scratch},
    ) as cluster:
        address = cluster.scheduler_address
        compute = two_machines(join_timeout=300).model_copy(update={"machine_scheduler": address})
        job = untracked_train_job("sft", {"max_steps": 1}, TrainInputs(policy, data, compute=compute), tmp_path / "s")
        lines: list[str] = []
        started = time.monotonic()
        with pytest.raises(LaunchFailed) as failed:
            launch(job, "sft", lines.append)
        assert time.monotonic() - started < 10
        assert not cluster.scheduler.tasks  # nothing submitted
    dask = Path(sys.executable).parent / "dask"
    worker = f"{dask} worker {address} --nthreads 1 --resources alignflow-machine-1=1"
    assert str(failed.value) == (
        f"sft: no worker of the Dask scheduler {address} (compute.machine_scheduler) offers alignflow-machine-1, "
        f"which machine 1's part needs: on machine 1 run `cd {REPO} && ALIGNFLOW_HOME={get_settings().root} {worker}`"
    )
    assert lines == [] and not job.launch_dir.exists()  # no spec written, no part placed, no rank started


@pytest.mark.slow
def test_a_rank_that_fails_on_machine_1_stops_machine_0_with_its_traceback_and_leaves_no_process(workdir):
    section = {
        "max_steps": 3,
        "num_generations": 2,
        "generation_batch_size": 2,
        "per_device_train_batch_size": 1,
        "max_completion_length": 4,
        "log_completions_steps": 0,
        "reward_funcs": ["ddp_failing_rewards:constant"],
        "beta": 0.0,
    }
    started = time.monotonic()
    error, returncode, output, job = train_on_two_machines(
        workdir, "grpo", section, "grpo-fails", ("ddp_failing_rewards",)
    )
    assert isinstance(error, LaunchFailed)
    assert "train: rank 1 failed (ConnectionError)" in str(error)
    assert "ConnectionError: the reward server cannot be reached from rank 1" in str(error)
    assert returncode == 1 and "machine 1: rank 1 failed (ConnectionError)" in output, output
    assert time.monotonic() - started < 40  # not the rendezvous' timeout (60 s here, 300 s by default)
    assert processes_naming(str(job.launch_dir)) == []
    assert not (job.folder.model_dir).exists()


@pytest.mark.slow
def test_killing_machine_1_mid_stage_fails_both_sides_and_the_rerun_resumes_to_the_uninterrupted_weights(workdir):
    from trainers.runtime.checkpoints import checkpoints, discard_incomplete_checkpoints, is_complete

    spec, folder = workdir
    section = {"max_steps": 40, "save_steps": 2, "per_device_train_batch_size": 2, "logging_steps": 1}
    section |= {"learning_rate": 1e-4, "lr_scheduler_type": "constant", "eval_strategy": "no", "seed": 0}
    train(workdir, "dpo", section, 2, "dpo-whole")  # uninterrupted, 1 machine × 2 processes
    job = untracked_train_job(
        "dpo", section, TrainInputs(spec["policy"], spec["data"], compute=two_machines()), folder / "dpo-killed"
    )
    machine_one = MachineOne(job.spec_file, folder, folder / "dpo-killed-machine-1.log")
    starter = machine_one.start_when_ready()
    outcome: list[BaseException] = []

    def machine_zero() -> None:
        try:
            run(job, folder)
        except BaseException as error:  # noqa: BLE001 (handed to the test)
            outcome.append(error)

    zero = threading.Thread(target=machine_zero)
    zero.start()
    starter.join()
    deadline = time.monotonic() + 120
    while not any(is_complete(c) for c in job.folder.path.glob("checkpoint-*")):
        assert time.monotonic() < deadline and zero.is_alive(), "no checkpoint before the end"
        time.sleep(0.05)
    machine_one.process.send_signal(signal.SIGKILL)  # machine 1's part, as a worker killed with it
    killed_at = time.monotonic()
    zero.join(timeout=90)
    assert not zero.is_alive() and isinstance(outcome[0], LaunchFailed), outcome
    assert time.monotonic() - killed_at < 45  # gloo's closed connection, or the heartbeat (30 s)
    # rank 0's closed connection (then machine 1 neither beat nor reported a failure), or the heartbeat
    assert str(outcome[0]).startswith(
        ("train: machine 1 stopped answering and reported no failure", "train: stopped: machine 1 stopped answering")
    ), outcome
    assert gone_within(str(job.launch_dir), 30) == []  # machine 1's ranks stop on their launcher's death
    assert not job.folder.model_dir.exists()

    discard_incomplete_checkpoints(job.folder.path)
    latest = checkpoints(job.folder.path)[0]
    assert 2 <= int(latest.name.rsplit("-", 1)[1]) < 40
    resumed = job.model_copy(update={"checkpoint": latest})
    machine_one = MachineOne(job.spec_file, folder, folder / "dpo-resumed-machine-1.log")
    starter = machine_one.start_when_ready()
    run(resumed, folder)
    starter.join()
    assert machine_one.finish()[0] == 0
    assert largest_difference(weights(folder / "dpo-whole"), weights(folder / "dpo-killed")) <= 1e-6


@pytest.mark.unit
def test_the_launch_command_is_built_from_the_compute_section():
    from infra.core.config import ACCELERATE_CONFIG_DIR

    two_machines = ComputeConfig(
        num_processes=4,
        num_machines=2,
        machine_rank=1,
        main_process_ip="10.0.0.1",
        main_process_port=29600,
        mixed_precision="bf16",
        accelerate_config="zero3",
    )
    command = two_machines.launch_command("spec.json", RANK_MODULE)
    assert command[1:] == [
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ACCELERATE_CONFIG_DIR / "zero3.yaml"),
        "--num_processes",
        "4",
        "--num_machines",
        "2",
        "--machine_rank",
        "1",
        "--main_process_port",
        "29600",
        "--mixed_precision",
        "bf16",
        "--dynamo_backend",
        "no",
        "--main_process_ip",
        "10.0.0.1",
        "--rdzv_conf",
        "timeout=300",
        "-m",
        "tasks.launched_rank",
        "spec.json",
    ]
    # several CPU processes: --multi_gpu, never --cpu (which starts one process)
    several = ComputeConfig(cpu=True, num_processes=2).launch_command("spec.json", RANK_MODULE)
    assert "--multi_gpu" in several and "--cpu" not in several
    assert "--multi_gpu" not in ComputeConfig().launch_command("spec.json", RANK_MODULE)


@pytest.mark.unit
def test_a_group_may_straddle_processes_but_a_generation_batch_holds_whole_groups():
    from trainers.grpo.layout import resolve_layout
    from trainers.grpo.rollouts import completion_seed

    layout = resolve_layout(per_device_batch_size=2, gradient_accumulation_steps=1, num_generations=4, num_processes=2)
    assert (layout.generation_batch_size, layout.per_device_generation_batch_size, layout.prompts_per_generation) == (
        4,
        2,
        1,
    )
    with pytest.raises(ValueError, match=r"processes × steps_per_generation \(2 × 3 × 1 = 6\) must be divisible by"):
        resolve_layout(per_device_batch_size=2, gradient_accumulation_steps=1, num_generations=4, num_processes=3)
    seeds = {completion_seed(7, generation, row) for generation in (1, 2) for row in range(4)}
    assert len(seeds) == 8


@contextmanager
def one_torch_thread():
    """The in-process side of a comparison with ranks of one torch thread each (their reductions alike)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def launch_log(monkeypatch, caplog):
    """Ranks of one torch thread; the launch lines (``tasks.launch.run_log``) in ``caplog``."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    with caplog.at_level(logging.INFO, logger="alignflow"):
        yield caplog


def computed_entry(data, policy, root: Path, processes: int, view: str, plugins: tuple[str, ...] = ()):
    """The reference-cache entry of ``view`` in batches of 5, computed (not found) over ``processes``."""
    from tasks.reference import ensure_entry, reference_key

    ref = ReferenceLogps(
        key=reference_key(data, policy, view=view),
        root=str(root),
        data=data,
        reference=policy,
        batch_size=5,
        compute=cpu(processes),
        view=view,
        plugins=plugins,
    )
    with one_torch_thread():
        entry, computed = ensure_entry(ref)
    assert computed
    return entry


@pytest.mark.slow
@pytest.mark.parametrize("view", ["pairs", "kto"])
def test_the_reference_task_over_two_processes_writes_the_cache_entry_one_process_writes(
    view, handles, tmp_path, launch_log
):
    from trainers.scoring.reference_views import REFERENCE_VIEWS

    policy, data, _ = handles
    assert data.rows["preference"] > 2 * 5 and data.rows["preference"] % 5  # batches on both ranks, the last short
    entries = {}
    for processes in (1, 2):
        entries[processes] = computed_entry(data, policy, tmp_path / f"cache-{processes}", processes, view)
    assert "reference log-probs on 2 processes: " in launch_log.text  # launched, not run in this process
    assert entries[2].rows == entries[1].rows == REFERENCE_VIEWS[view].rows(data.rows)
    assert entries[1].rows == (
        {"preference": data.rows["preference"], "preference_eval": data.rows["preference_eval"]}
        if view == "pairs"
        else {"kto": 2 * data.rows["preference"], "kto_eval": 2 * data.rows["preference_eval"]}
    )
    assert entries[2].digest == entries[1].digest  # the same Parquet bytes: bit-identical log-probs
    assert list(get_settings().launches.glob("reference-*")) == []  # the launch folder goes with the launch


@pytest.mark.slow
def test_a_plugins_reference_view_over_two_processes_is_scored_as_one_process_scores_it(
    handles, tmp_path, launch_log, monkeypatch
):
    """The pass launched with the plugins of its handle (the config's): its ranks know the view."""
    from trainers.plugins import import_plugins
    from trainers.scoring.reference_views import REFERENCE_VIEWS

    policy, data, _ = handles
    (tmp_path / "ddp_views.py").write_text(textwrap.dedent(VIEW_PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    import_plugins(["ddp_views"])
    entries = {}
    try:
        for view, processes in (("pairs", 1), ("swapped_pairs", 1), ("swapped_pairs", 2)):
            root = tmp_path / f"cache-{view}-{processes}"
            entries[view, processes] = computed_entry(data, policy, root, processes, view, ("ddp_views",))
    finally:
        REFERENCE_VIEWS.pop("swapped_pairs")
        sys.modules.pop("ddp_views")
    assert "reference log-probs on 2 processes: " in launch_log.text  # launched, not run in this process
    pairs, one, two = entries["pairs", 1], entries["swapped_pairs", 1], entries["swapped_pairs", 2]
    assert two.digest == one.digest  # the same Parquet bytes: bit-identical log-probs
    assert (
        two.rows
        == pairs.rows
        == {"preference": data.rows["preference"], "preference_eval": data.rows["preference_eval"]}
    )
    for split, table in two.tables.items():  # the plugin's view: each pair's two log-probs swapped
        for column, swapped in (("ref_chosen_logps", "ref_rejected_logps"), ("ref_rejected_logps", "ref_chosen_logps")):
            expected = pairs.tables[split].column(swapped).to_pylist()
            assert table.column(column).to_pylist() == pytest.approx(expected, abs=1e-6), (split, column)
    assert two.tables["preference"].column("row_id").to_pylist() == list(range(data.rows["preference"]))


@pytest.mark.slow
def test_the_evaluation_task_over_two_processes_scores_what_one_process_scores(workdir, teacher_checkpoint, launch_log):
    """Two models in one launch, the reference (the policy) without the pairs: each model's scores
    are one process's."""
    from tasks.evaluate import Scoring, score_models

    spec, _ = workdir
    splits = datasets.load_from_disk(str(spec["splits"]))
    prompts, pairs = splits["grpo_prompts"].to_list(), splits["preference"].to_list()  # 8 prompts, 16 pairs
    # 3 prompt batches (2 + 1 over the processes), 6 pair batches; seeded sampling in every batch
    evaluation = EvaluationConfig(max_new_tokens=3, num_samples=2, pass_k=[1, 2], batch_size=3, seed=5)
    models = [spec["policy"], teacher_checkpoint]
    scoring = Scoring(prompts, pairs, evaluation, 0.1, ComputeConfig(cpu=True), reference=spec["policy"].fingerprint)
    with one_torch_thread():
        one = list(score_models(models, scoring))
    two = list(score_models(models, dataclasses.replace(scoring, compute=cpu(2))))
    assert launch_log.text.count("evaluation of init, teacher on 2 processes: ") == 1  # one launch
    assert "evaluation of init on" not in launch_log.text
    assert two == one
    reference, teacher = one
    assert {"greedy_accuracy", "sampled_accuracy", "pass_at_2", "rewards/accuracies"} <= teacher.metrics.keys()
    assert "rewards/accuracies" not in reference.metrics and "pass_at_2" in reference.metrics
    assert reference.samples["completion"] != teacher.samples["completion"]  # other weights, other samples
    assert len(teacher.per_prompt["sampled_accuracy"]) == 8 and len(teacher.samples["completion"]) == 8
    # the samples differ between batches: each batch has its own seed, not one stream cut in shards
    assert len(set(reference.samples["completion"])) > 1
    assert list(get_settings().launches.glob("evaluate-*")) == []


@pytest.mark.slow
def test_suites_over_two_processes_score_what_one_process_scores(workdir, teacher_checkpoint, launch_log, tmp_path):
    """lm-evaluation-harness tasks (a generated one and a multiple-choice one) launched over two
    processes, each running its share of the requests: the first process's metrics on both, the
    same as one process's."""
    from tasks.evaluate import Scoring, score_models

    spec, _ = workdir
    builtin = AdditionTaskConfig(max_operand=9, num_eval_problems=20)
    suites = [{"task": str(choice_task(tmp_path)), "batch_size": 4}, {"task": "builtin:addition", "batch_size": 4}]
    evaluation = EvaluationConfig(num_prompts=7, suites=suites)  # 7 addition documents, 30 choice ones
    resolved = evaluation.resolved_suites(builtin, tmp_path)
    models = [spec["policy"], teacher_checkpoint]
    scoring = Scoring([], None, evaluation, None, ComputeConfig(cpu=True), suites=resolved, builtin=builtin)
    with one_torch_thread():
        one = list(score_models(models, scoring))
    two = list(score_models(models, dataclasses.replace(scoring, compute=cpu(2))))
    assert launch_log.text.count("evaluation of init, teacher on 2 processes: ") == 1
    # each process ran its share: the first process's progress lines, 45 of the 90 choices' log-likelihoods
    assert "loglikelihood requests: 100%" in launch_log.text and "| 45/45 [" in launch_log.text
    assert "| 90/90 [" not in launch_log.text
    assert_suites_as_one_process(two, one)
    assert one[0].metrics["addition_choice/acc/none"] != one[1].metrics["addition_choice/acc/none"]


@pytest.mark.unit
@pytest.mark.parametrize(
    "items, processes, bounds",
    [(6, 2, [(0, 3), (3, 6)]), (3, 2, [(0, 2), (2, 3)]), (1, 2, [(0, 1), (1, 1)]), (7, 3, [(0, 3), (3, 5), (5, 7)])],
)
def test_shards_are_contiguous_disjoint_and_complete(items, processes, bounds):
    from trainers.runtime.work_split import batches_of, shard_bounds

    assert [shard_bounds(items, processes, index) for index in range(processes)] == bounds
    assert batches_of(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5], [6]]
