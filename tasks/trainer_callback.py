"""The Trainer callback that tracks a training stage in its MLflow run."""

from __future__ import annotations

from pathlib import Path

from transformers import TrainerCallback

from tasks.tracking import client, log_metrics
from trainers.stages.grpo import COMPLETIONS_LOG_KEY

COMPLETIONS_TABLE = "completions.json"


class MlflowTrainerCallback(TrainerCallback):
    """Logs every Trainer log as metrics, tables of sample completions (GRPO's ``completions`` log,
    one table with a ``step`` column) and, with ``log_checkpoints``, every saved checkpoint as
    artifacts (rank 0 only)."""

    def __init__(self, run_id: str, log_checkpoints: bool = True):
        self.run_id = run_id
        self.log_checkpoints = log_checkpoints

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            log_metrics(self.run_id, logs, step=state.global_step)
            if COMPLETIONS_LOG_KEY in logs:
                client().log_table(self.run_id, data=logs[COMPLETIONS_LOG_KEY], artifact_file=COMPLETIONS_TABLE)

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.log_checkpoints:
            checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if checkpoint.is_dir():
                client().log_artifacts(self.run_id, str(checkpoint), f"checkpoints/{checkpoint.name}")
