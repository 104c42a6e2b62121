"""Kill a real ``alignflow run`` with SIGKILL during a stage, rerun it identically, and compare with
an uninterrupted run: the harness of ``tests/test_kill_resume.py`` and ``benchmarks/kill_resume.py``.

Every run has a state folder of its own (its own MLflow store, caches and outputs); give them one
Prefect API (``PREFECT_API_URL``) to spare each a temporary server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from helpers import mlflow_client
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
NAME = "killtest"
STAGES = ("sft", "dpo", "grpo")
# The other stages, in one chain the config also describes (``stages=[…]``): the reward model
# passes the policy by, KTO trains from SFT's model, distillation from KTO's.
TOOLBOX = ("sft", "reward", "kto", "distill")
# Enough steps after each stage's first checkpoint to kill it there; checkpoints at logging steps
# (logging_steps=1), DPO with bco_pair's running mean, GRPO with checkpoints inside a generation
# batch (save_steps=3, two steps per batch).
CONFIG = f"""
name: {NAME}
data:
  builtin: {{max_operand: 9, noise: 0.3, num_eval_problems: 8, seed: 0}}
sft: {{max_steps: 24, per_device_train_batch_size: 16, logging_steps: 1, save_steps: 3}}
dpo: {{max_steps: 24, per_device_train_batch_size: 8, logging_steps: 1, save_steps: 3, beta: 0.5, loss_type: bco_pair}}
grpo:
  max_steps: 18
  per_device_train_batch_size: 8
  num_generations: 4
  steps_per_generation: 2
  logging_steps: 1
  save_steps: 3
  entropy_coef: 0.1
  log_completions_steps: 6
kto: {{max_steps: 24, per_device_train_batch_size: 8, logging_steps: 1, save_steps: 3}}
reward: {{max_steps: 24, per_device_train_batch_size: 8, logging_steps: 1, save_steps: 3, head: likelihood}}
distill:
  max_steps: 24
  per_device_train_batch_size: 8
  logging_steps: 1
  save_steps: 3
  teacher_model: "builtin:tiny-llama"
  max_new_tokens: 6
evaluation: {{num_prompts: 4, num_samples: 2}}
"""


def compared(metric: str) -> bool:
    """Not wall times, nor the Trainer's closing ``train_loss`` (the mean over the last attempt's steps only)."""
    return not (metric.startswith("time/") or metric.endswith(("_runtime", "_per_second")) or metric == "train_loss")


def write_config(folder: Path) -> Path:
    path = folder / f"{NAME}.yaml"
    path.write_text(CONFIG)
    return path


def environment(home: Path, prefect_api_url: str | None) -> dict[str, str]:
    env = {**os.environ, "ALIGNFLOW_HOME": str(home), "OMP_NUM_THREADS": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    if prefect_api_url:
        env["PREFECT_API_URL"] = prefect_api_url
    return env


def command(config: Path, overrides: list[str] = ()) -> list[str]:
    return [sys.executable, "-m", "infra.ops.cli", "run", str(config), *overrides]


def run(
    config: Path, home: Path, prefect_api_url: str | None, overrides: list[str] = (), timeout: float = 600
) -> subprocess.CompletedProcess:
    """``alignflow run config overrides…`` in state folder ``home``; on failure, raise with its output."""
    env = environment(home, prefect_api_url)
    result = subprocess.run(
        command(config, overrides), cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    if result.returncode != 0:
        output = result.stdout[-3000:] + result.stderr[-3000:]
        raise AssertionError(f"alignflow run failed ({result.returncode}):\n{output}")
    return result


def stage_dir(home: Path, stage: str) -> Path | None:
    found = sorted((home / "outputs" / NAME).glob(f"{stage}-*"))
    return found[0] if found else None


def complete_checkpoints(folder: Path | None) -> list[int]:
    if folder is None:
        return []
    return sorted(int(m.parent.name.split("-")[1]) for m in folder.glob("checkpoint-*/checkpoint-complete.json"))


@dataclass
class Kill:
    stage: str
    after_step: int  # kill once the stage has a complete checkpoint of this step or a later one
    delay: float = 0.0  # seconds after that
    checkpoints_at_kill: list[int] = field(default_factory=list)
    seconds: float = 0.0  # from start to kill


def run_and_kill(
    config: Path, home: Path, prefect_api_url: str | None, kill: Kill, overrides: list[str] = (), timeout: float = 600
) -> Kill:
    """Start ``alignflow run``; once ``kill.stage`` has a complete checkpoint of step ``after_step``
    or later (and ``delay`` seconds more), SIGKILL its process group. Fails if the stage finished first."""
    started = time.monotonic()
    process = subprocess.Popen(
        command(config, overrides),
        cwd=ROOT,
        env=environment(home, prefect_api_url),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        while max(complete_checkpoints(stage_dir(home, kill.stage)), default=0) < kill.after_step:
            if process.poll() is not None:
                raise AssertionError(f"alignflow run ended ({process.returncode}) before {kill.stage} checkpointed")
            if time.monotonic() - started > timeout:
                raise AssertionError(f"no {kill.stage} checkpoint after {timeout} s")
            time.sleep(0.005)
        time.sleep(kill.delay)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    kill.seconds = time.monotonic() - started
    kill.checkpoints_at_kill = complete_checkpoints(stage_dir(home, kill.stage))
    if (stage_dir(home, kill.stage) / "model.json").exists():
        raise AssertionError(f"{kill.stage} finished before the kill: nothing was interrupted")
    return kill


def final_weights(home: Path, stage: str) -> dict:
    return load_file(stage_dir(home, stage) / "model" / "model.safetensors")


def max_weight_difference(a: Path, b: Path, stage: str) -> float:
    first, second = final_weights(a, stage), final_weights(b, stage)
    assert first.keys() == second.keys()
    return max((first[k].double() - second[k].double()).abs().max().item() for k in first)


def stage_run_id(home: Path, stage: str) -> str:
    return (stage_dir(home, stage) / "mlflow_run_id").read_text().strip()


def metric_histories(home: Path, stage: str) -> dict[str, list[tuple[int, float]]]:
    """``metric -> [(step, value)]`` of the stage's MLflow run, in logging order."""
    client, run_id = mlflow_client(home), stage_run_id(home, stage)
    metrics = client.get_run(run_id).data.metrics
    return {key: [(m.step, m.value) for m in client.get_metric_history(run_id, key)] for key in metrics}


def duplicate_steps(histories: dict[str, list[tuple[int, float]]]) -> dict[str, list[int]]:
    duplicates = {}
    for key, points in histories.items():
        steps = [step for step, _ in points]
        if len(steps) != len(set(steps)):
            duplicates[key] = sorted({s for s in steps if steps.count(s) > 1})
    return duplicates


def compare_metrics(resumed: dict, reference: dict, tolerance: float = 1e-4) -> list[str]:
    """Differences from the uninterrupted run: the same metrics at the same steps, the same values
    (wall-time metrics excepted)."""
    problems = []
    if resumed.keys() != reference.keys():
        problems.append(f"metrics differ: {sorted(resumed.keys() ^ reference.keys())}")
    for key in sorted(resumed.keys() & reference.keys()):
        ours, theirs = dict(resumed[key]), dict(reference[key])
        if sorted(ours) != sorted(theirs):
            problems.append(f"{key}: steps {sorted(ours)} != {sorted(theirs)}")
        elif compared(key):
            far = [s for s in ours if abs(ours[s] - theirs[s]) > tolerance * max(1.0, abs(theirs[s]))]
            if far:
                problems.append(f"{key}: values differ at steps {far}")
    return problems


def stage_snapshot(home: Path, stage: str) -> dict:
    """What retraining would change: the finished model's handle and the checkpoints' markers."""
    folder = stage_dir(home, stage)
    markers = {m.parent.name: m.read_text() for m in folder.glob("checkpoint-*/checkpoint-complete.json")}
    return {"model.json": (folder / "model.json").read_text(), "checkpoints": markers}


def latest_flow_run_id(home: Path) -> str:
    client = mlflow_client(home)
    experiment = client.get_experiment_by_name("alignflow")
    (parent,) = client.search_runs(
        [experiment.experiment_id], "tags.`alignflow.kind` = 'experiment'", order_by=["start_time DESC"], max_results=1
    )
    return parent.data.tags["prefect.flow_run_id"]


def stage_run_tags(home: Path, stage: str) -> dict[str, str]:
    return mlflow_client(home).get_run(stage_run_id(home, stage)).data.tags


def summary(kill: Kill) -> str:
    return json.dumps({"stage": kill.stage, "checkpoints_at_kill": kill.checkpoints_at_kill, "seconds": kill.seconds})
