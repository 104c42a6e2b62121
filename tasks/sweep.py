"""A sweep's bookkeeping: its trials' results, the Prefect concurrency limit that bounds them, and
the sweep's MLflow run (trials table, seed-aggregated table, best trial)."""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from typing import Any, Iterator, Literal, Mapping

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.exceptions import ObjectNotFound
from pydantic import BaseModel

from infra.core.sweep import SweepConfig
from tasks.compare import FINAL_PREFIX
from tasks.mlflow_runs import client, experiment_id, log_metrics, mlflow_run_url
from tasks.reporting import markdown_table, seed_aggregates, seed_table_markdown


class TrialResult(BaseModel):
    number: int
    params: dict[str, Any]
    status: Literal["completed", "failed", "invalid"]
    mlflow_run_id: str | None = None
    flow_run_id: str | None = None
    metrics: dict[str, float] = {}  # the final stage's evaluation metrics (`final/<metric>` of its run)
    error: str | None = None
    lost_attempts: int = 0  # earlier attempts whose process was lost (a Dask worker that died): it ran again

    def objective(self, metric: str) -> float | None:
        value = self.metrics.get(metric) if self.status == "completed" else None
        return value if value is not None and math.isfinite(value) else None


@contextmanager
def trial_slots(name: str, limit: int) -> Iterator[str]:
    """A Prefect global concurrency limit of ``limit`` slots for the sweep's trials, removed afterwards."""
    with get_client(sync_client=True) as prefect:
        prefect.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=limit))
    try:
        yield name
    finally:
        with get_client(sync_client=True) as prefect:
            prefect.delete_global_concurrency_limit_by_name(name)


def check_deployment(name: str) -> None:
    """The deployment trials would run as exists on the Prefect server (before any trial starts)."""
    with get_client(sync_client=True) as prefect:
        try:
            prefect.read_deployment_by_name(name)
        except ObjectNotFound:
            raise ValueError(
                f"deployment: {name!r} is not on the Prefect server; `alignflow deploy` registers it"
            ) from None


def trial_run_id(experiment: str, sweep_run_id: str, flow_run_id: str) -> str | None:
    """The MLflow run of the trial's experiment flow run, nested under the sweep's run."""
    runs = client().search_runs(
        [experiment_id(experiment)],
        f"tags.mlflow.parentRunId = '{sweep_run_id}' and tags.`prefect.flow_run_id` = '{flow_run_id}'",
    )
    return runs[0].info.run_id if runs else None


LOST_ATTEMPT = "alignflow.lost_attempt"


def fail_lost_attempts(experiment: str, sweep_run_id: str, run_name: str) -> int:
    """Mark FAILED the trial's earlier attempts still RUNNING under the sweep's run, as the trial
    starts again: their process was lost (Dask reschedules a trial whose worker died), so nothing
    else would end them. A trial runs one attempt at a time, so a RUNNING one is never live here."""
    lost = client().search_runs(
        [experiment_id(experiment)],
        f"tags.mlflow.parentRunId = '{sweep_run_id}' and tags.mlflow.runName = '{run_name}' "
        "and attributes.status = 'RUNNING'",
    )
    for run in lost:
        # its stage and evaluation runs, left RUNNING with it
        children = client().search_runs(
            [run.info.experiment_id],
            f"tags.mlflow.parentRunId = '{run.info.run_id}' and attributes.status = 'RUNNING'",
        )
        for ended in [*children, run]:
            client().set_tag(ended.info.run_id, LOST_ATTEMPT, "its process was lost mid-trial; the trial ran again")
            client().set_terminated(ended.info.run_id, status="FAILED")
    return len(lost)


def final_metrics(run_id: str) -> dict[str, float]:
    metrics = client().get_run(run_id).data.metrics
    return {k.removeprefix(FINAL_PREFIX): v for k, v in metrics.items() if k.startswith(FINAL_PREFIX)}


def best_trial(trials: list[TrialResult], metric: str, direction: str) -> TrialResult | None:
    """The completed trial with the best ``metric`` (the lowest number among equals)."""
    scored = [(value, t) for t in trials if (value := t.objective(metric)) is not None]
    if not scored:
        return None
    sign = 1 if direction == "maximize" else -1
    return max(scored, key=lambda pair: (sign * pair[0], -pair[1].number))[1]


def separation(trials: list[TrialResult], best: TrialResult, metric: str, direction: str) -> str | None:
    """Why the best trial does not win on a real difference, or None when it does (or is alone):
    the runner-up ties it, or lies inside the best trial's confidence interval of ``metric``
    (the evaluation's bootstrap ``<metric>_ci_low`` / ``_ci_high``, where it has one)."""
    runner = best_trial([t for t in trials if t is not best], metric, direction)
    if runner is None:
        return None
    sign = 1 if direction == "maximize" else -1
    value, other = best.objective(metric), runner.objective(metric)
    assert value is not None and other is not None, "best_trial picks among the scored trials"
    if value == other:
        return f"trial {best.number} ties with trial {runner.number} ({metric} = {value:.3f})"
    bound = best.metrics.get(f"{metric}_ci_low" if direction == "maximize" else f"{metric}_ci_high")
    if bound is not None and sign * other >= sign * bound:
        low, high = best.metrics[f"{metric}_ci_low"], best.metrics[f"{metric}_ci_high"]
        return (
            f"trial {runner.number} ({metric} = {other:.3f}) lies inside trial {best.number}'s 95% interval "
            f"[{low:.3f}, {high:.3f}]"
        )
    return None


def trial_rows(trials: list[TrialResult], metric: str) -> list[Mapping[str, object]]:
    return [
        {"trial": t.number, "status": t.status, "lost attempts": t.lost_attempts}
        | {key: str(value) for key, value in t.params.items()}
        | {metric: value if (value := t.objective(metric)) is not None else math.nan}
        | {"MLflow run": t.mlflow_run_id or "", "error": (t.error or "").splitlines()[0][:200] if t.error else ""}
        for t in sorted(trials, key=lambda t: t.number)
    ]


@task(name="log-sweep")
def log_sweep(spec: SweepConfig, trials: list[TrialResult], sweep_run_id: str) -> tuple[str, str, TrialResult | None]:
    """On the sweep's MLflow run: each trial's objective as ``trial/<metric>`` (step = trial number),
    the trials table, the seed-aggregated table over completed trials, the best trial (tags and
    ``best/<metric>``) and which trials failed; the same tables as the Prefect artifact ``sweep``."""
    metric = spec.objective.metric
    for t in trials:
        if (value := t.objective(metric)) is not None:
            log_metrics(sweep_run_id, {f"trial/{metric}": value}, step=t.number)
    table = markdown_table(trial_rows(trials, metric))
    completed = [(t.params, t.metrics) for t in sorted(trials, key=lambda t: t.number) if t.status == "completed"]
    aggregates = seed_aggregates(completed)
    seed_table = seed_table_markdown(aggregates) if aggregates else "no completed trial\n"
    client().log_text(sweep_run_id, table, "trials.md")
    client().log_text(sweep_run_id, json.dumps([t.model_dump() for t in trials], indent=2), "trials.json")
    client().log_text(sweep_run_id, seed_table, "seed_table.md")
    client().log_text(sweep_run_id, json.dumps(aggregates, indent=2, default=str), "seed_table.json")
    failed = sorted(t.number for t in trials if t.status != "completed")
    tags = {"alignflow.sweep.trials": str(len(trials)), "alignflow.sweep.failed": ",".join(map(str, failed))}
    best = best_trial(trials, metric, spec.objective.direction)
    best_line = "none"
    if best is not None and (best_value := best.objective(metric)) is not None:  # best_trial's are scored
        tags |= {"alignflow.best_trial": str(best.number), "alignflow.best_run_id": best.mlflow_run_id or ""}
        log_metrics(sweep_run_id, {f"best/{metric}": best_value})
        best_line = f"trial {best.number} ({metric} = {best_value:.3f})"
        if unseparated := separation(trials, best, metric, spec.objective.direction):
            tags["alignflow.best_separated"] = f"no: {unseparated}"
            best_line += f", not separated from the others: {unseparated}"
            get_run_logger().warning("the sweep could not separate its best trial: %s", unseparated)
        else:
            tags["alignflow.best_separated"] = "yes"
    for key, tag in tags.items():
        client().set_tag(sweep_run_id, key, tag)
    run = client().get_run(sweep_run_id)
    create_markdown_artifact(
        key="sweep",
        markdown=f"## Sweep {spec.name}: {len(trials)} trials, {len(failed)} failed, best {best_line}\n\n{table}\n"
        f"### Over seeds (mean ± sd)\n\n{seed_table}\n"
        f"MLflow: [sweep run]({mlflow_run_url(run.info.experiment_id, sweep_run_id)}).\n",
        description="alignflow sweep",
    )
    return table, seed_table, best
