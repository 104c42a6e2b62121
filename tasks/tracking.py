"""MLflow tracking: one parent run per flow run, one child run per stage, Trainer logs.

Every call names its run id explicitly: tasks may run in worker threads, where MLflow's
fluent "active run" is not visible.
"""

from __future__ import annotations

import math
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import yaml
from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunStatus
from prefect.runtime import flow_run
from transformers import TrainerCallback

from infra.config import ExperimentConfig
from infra.settings import get_settings
from trainers.grpo import COMPLETIONS_LOG_KEY

RUN_ID_FILE = "mlflow_run_id"
MAX_BATCH = 100


def client() -> MlflowClient:
    return MlflowClient(get_settings().mlflow_tracking_uri)


def experiment_id(name: str) -> str:
    found = client().get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    root = get_settings().mlflow_artifact_location
    return client().create_experiment(name, artifact_location=f"{root}/{name}" if root else None)


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def log_params(run_id: str, params: dict) -> None:
    items = [Param(k, str(v)[:6000]) for k, v in params.items()]
    for start in range(0, len(items), MAX_BATCH):
        client().log_batch(run_id, params=items[start : start + MAX_BATCH])


def log_metrics(run_id: str, metrics: dict[str, float], step: int = 0) -> None:
    now = int(time.time() * 1000)
    items = [Metric(k, float(v), now, step) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)]
    for start in range(0, len(items), MAX_BATCH):
        client().log_batch(run_id, metrics=items[start : start + MAX_BATCH])


def start_parent_run(config: ExperimentConfig) -> str:
    tags = {
        "alignflow.config_hash": config.content_hash(),
        "mlflow.source.git.commit": git_commit(),
        "prefect.flow_run_id": str(flow_run.get_id() or ""),
        "prefect.flow_run_name": str(flow_run.get_name() or ""),
    }
    run = client().create_run(experiment_id(config.tracking.experiment_name), run_name=config.tracking.run_name or config.name, tags=tags)
    log_params(run.info.run_id, config.flat())
    client().log_text(run.info.run_id, yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), "config.yaml")
    return run.info.run_id


@contextmanager
def tracked_run(run_id: str) -> Iterator[str]:
    """Mark ``run_id`` FINISHED when the block completes, FAILED when it raises."""
    try:
        yield run_id
    except BaseException:
        client().set_terminated(run_id, RunStatus.to_string(RunStatus.FAILED))
        raise
    client().set_terminated(run_id, RunStatus.to_string(RunStatus.FINISHED))


def stage_output_dir(config_name: str, stage: str) -> Path:
    """``outputs/<config name>/<flow run id>/<stage>``: checkpoints, final model, run id."""
    return get_settings().outputs / config_name / str(flow_run.get_id() or "local") / stage


def stage_run_id(parent_run_id: str, stage: str, output_dir: Path) -> str:
    """The stage's child run, created once and remembered in its output folder, so a retried
    stage logs into the same run."""
    id_file = output_dir / RUN_ID_FILE
    if id_file.exists():
        run_id = id_file.read_text().strip()
        client().update_run(run_id, status="RUNNING")
        return run_id
    parent = client().get_run(parent_run_id)
    run = client().create_run(
        parent.info.experiment_id,
        run_name=stage,
        tags={"mlflow.parentRunId": parent_run_id, "alignflow.stage": stage, **{k: v for k, v in parent.data.tags.items() if k.startswith(("prefect.", "alignflow.config"))}},
    )
    output_dir.mkdir(parents=True, exist_ok=True)
    id_file.write_text(run.info.run_id)
    return run.info.run_id


COMPLETIONS_TABLE = "completions.json"


class MlflowTrainerCallback(TrainerCallback):
    """Logs every Trainer log as metrics, every saved checkpoint as artifacts and tables of sample
    completions (GRPO's ``completions`` log, one table with a ``step`` column) (rank 0 only)."""

    def __init__(self, run_id: str):
        self.run_id = run_id

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            log_metrics(self.run_id, logs, step=state.global_step)
            if COMPLETIONS_LOG_KEY in logs:
                client().log_table(self.run_id, data=logs[COMPLETIONS_LOG_KEY], artifact_file=COMPLETIONS_TABLE)

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if checkpoint.is_dir():
                client().log_artifacts(self.run_id, str(checkpoint), f"checkpoints/{checkpoint.name}")
