"""The Trainer callback that tracks a training stage in its MLflow run."""

from __future__ import annotations

from pathlib import Path

from transformers import TrainerCallback

from infra.core.settings import get_settings
from tasks.metric_sender import MetricSender
from tasks.mlflow_runs import client, metric_values

COMPLETIONS_TABLE = "completions.json"


def last_logged_steps(run_id: str, table: str | None = None) -> dict[str, int]:
    """``metric -> the last step the run has of it``; the completions ``table`` counts as logged up
    to the last step of any metric (it is logged with them)."""
    metrics = client().get_run(run_id).data.metrics
    steps = {key: max(m.step for m in client().get_metric_history(run_id, key)) for key in metrics}
    return steps | ({table: max(steps.values(), default=-1)} if table is not None else {})


class MlflowTrainerCallback(TrainerCallback):
    """Logs every Trainer log as metrics, the log of sample completions ``table`` names (the stage's
    :attr:`~trainers.stages.spec.StageSpec.completions_table`: GRPO's, one table with a ``step``
    column) as a table and, with ``log_checkpoints``, every saved checkpoint as
    artifacts (rank 0 only).

    Metrics go through a :class:`~tasks.metric_sender.MetricSender`: training never waits for MLflow;
    the end of training waits (``ALIGNFLOW_METRICS_FLUSH_TIMEOUT`` seconds at most) until they are
    delivered and fails the stage if they cannot be."""

    def __init__(
        self,
        run_id: str,
        log_checkpoints: bool = True,
        metrics: MetricSender | None = None,
        table: str | None = None,
    ):
        self.run_id = run_id
        self.log_checkpoints = log_checkpoints
        self.table = table
        self.metrics = metrics or MetricSender.for_run(run_id, get_settings().mlflow_tracking_uri)
        self.last_step = last_logged_steps(run_id, table)  # a resumed stage re-runs steps an earlier attempt logged

    def on_train_begin(self, args, state, control, **kwargs):
        """A resumed stage first sends what its checkpoint's log history holds and the run lacks: an
        attempt killed right after saving a checkpoint may not have delivered that step's metrics,
        and the resumed one starts at the step after it."""
        for entry in state.log_history:
            self.log_new(state, {key: value for key, value in entry.items() if key != "step"}, entry["step"])

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.log_new(state, logs or {}, state.global_step)

    def log_new(self, state, logs: dict, step: int) -> None:
        """The values of ``logs`` at ``step`` that the run does not have yet (rank 0 only)."""
        if state.is_world_process_zero and logs:
            new = {key: value for key, value in logs.items() if step > self.last_step.get(key, -1)}
            self.last_step |= dict.fromkeys(new, step)
            self.metrics.submit(metric_values(new, step=step))
            if self.table is not None and self.table in new:
                client().log_table(self.run_id, data=new[self.table], artifact_file=COMPLETIONS_TABLE)

    def on_train_end(self, args, state, control, **kwargs):
        self.metrics.close(get_settings().metrics_flush_timeout)

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.log_checkpoints:
            checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if checkpoint.is_dir():
                client().log_artifacts(self.run_id, str(checkpoint), f"checkpoints/{checkpoint.name}")
