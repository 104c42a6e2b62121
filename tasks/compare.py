"""Compare the experiment runs of an MLflow experiment: table, training curves, eval bars."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace

import yaml
from mlflow.entities import Run
from prefect import task
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel

from infra.core.settings import get_settings
from tasks.mlflow_runs import client, experiment_id, mlflow_run_url
from tasks.reporting import (
    RunSummary,
    comparison_rows,
    label_runs,
    markdown_table,
    plot_eval_bars,
    plot_training_curves,
)
from tasks.tracking import tracked_run
from trainers.catalog import stage_curves
from trainers.evaluation.harness import is_suite_metric

MAX_VARYING_PARAMS = 8
DEFAULT_METRICS = ["greedy_accuracy", "sampled_accuracy", "pass_at_4"]
FINAL_PREFIX = "final/"


class ComparisonReport(BaseModel):
    folder: str
    table: str
    baseline_run_id: str
    run_ids: list[str]
    mlflow_run_id: str
    stage: str  # whose training curves are plotted
    curves: list[str]


@dataclass(frozen=True)
class RunSelection:
    """Which finished experiment runs to compare: an MLflow search ``filter`` (e.g.
    ``params.`dpo.loss_type` = 'ipo'``), run ids or names, and the ``last`` N (by start time)."""

    filter: str | None = None
    runs: tuple[str, ...] = ()
    last: int | None = None


def experiment_runs(experiment: str, selection: RunSelection = RunSelection()) -> list[Run]:
    """The selected finished experiment-flow parent runs (a sweep's trials among them), oldest first."""
    query = "tags.`alignflow.kind` = 'experiment' and attributes.status = 'FINISHED'"
    if selection.filter:
        query += f" and {selection.filter}"
    runs: list[Run] = client().search_runs([experiment_id(experiment)], query, order_by=["attributes.start_time ASC"])
    if selection.runs:
        runs = [run for run in runs if {run.info.run_id, run.info.run_name} & set(selection.runs)]
    return runs[-selection.last :] if selection.last else runs


def select_baseline(runs: list[Run], baseline: str | None) -> Run:
    """``None``: the oldest run; else a run id, a run name, or a ``key=value`` tag (oldest match)."""
    if baseline is None:
        return runs[0]
    key, _, value = baseline.partition("=")
    for run in runs:
        if baseline in (run.info.run_id, run.info.run_name) or (value and run.data.tags.get(key) == value):
            return run
    raise ValueError(f"baseline {baseline!r} matches no finished run (run id, run name or key=value tag)")


def stage_run(parent: Run, stage: str) -> Run | None:
    """The run that trained ``stage``'s model for ``parent``: the one its ``alignflow.<stage>_run_id``
    tag names (an earlier run's, when the stage was a cache hit or reused), else its child run of
    that stage."""
    if trained := parent.data.tags.get(f"alignflow.{stage}_run_id"):
        return client().get_run(trained)
    children = client().search_runs(
        [parent.info.experiment_id],
        f"tags.mlflow.parentRunId = '{parent.info.run_id}' and tags.`alignflow.stage` = '{stage}'",
    )
    return children[0] if children else None


def summarize(run: Run, curves: list[str], stage: str) -> RunSummary:
    trained = stage_run(run, stage)
    histories = {}
    if trained is not None:
        histories = {
            m: [(p.step, p.value) for p in client().get_metric_history(trained.info.run_id, m)] for m in curves
        }
    final = {k.removeprefix(FINAL_PREFIX): v for k, v in run.data.metrics.items() if k.startswith(FINAL_PREFIX)}
    return RunSummary(run.info.run_id, run.info.run_name, dict(run.data.params), final, histories)


def logged_stages(params: dict[str, str]) -> list[str]:
    """The stages a run trained, as its logged ``stages`` config field lists them."""
    return yaml.safe_load(params.get("stages", "[]")) or []


def trained_fields(params: list[dict[str, str]]) -> list[dict[str, str]]:
    """Each run's config fields without those of the stages it does not train (of the stages some
    run here trains): a run without DPO logs a ``dpo.beta`` too, which trained nothing."""
    trained = [set(logged_stages(run)) for run in params]
    staged = set().union(*trained)
    fields = []
    for run, stages in zip(params, trained):
        untrained = staged - stages
        fields.append(
            {name: value for name, value in run.items() if "." not in name or name.partition(".")[0] not in untrained}
        )
    return fields


def differing_params(params: list[dict[str, str]]) -> list[str]:
    """The config fields whose values differ between the runs that have them: the top-level ones
    (``name``, ``stages``, ``seed``) first, then the sections' fields, each sorted."""
    names = sorted({name for run in params for name in run}, key=lambda name: ("." in name, name))
    return [name for name in names if len({run[name] for run in params if name in run}) > 1]


def curve_stage(stages: list[str], differing: list[str], final: str) -> str:
    """The stage whose curves tell the runs apart: the first whose settings differ (a β sweep
    shows DPO's curves, not those of the GRPO stage after it), else the final stage."""
    return next((s for s in stages if any(p.startswith(f"{s}.") for p in differing)), final)


@task(name="compare-runs")
def compare_runs(
    experiment: str,
    baseline: str | None = None,
    metrics: list[str] | None = None,
    curves: list[str] | None = None,
    params: list[str] | None = None,
    stage: str | None = None,
    selection: RunSelection = RunSelection(),
) -> ComparisonReport:
    """``metrics`` default to those of :data:`DEFAULT_METRICS` some run measured and every suite
    metric a run has (``trainers.evaluation.harness.is_suite_metric``; metrics named
    explicitly are shown even where no run has them, marked "not measured"); ``params`` to the
    config fields whose values differ between the runs, and label the runs; ``stage`` (whose
    training curves are plotted) to the first stage whose settings differ; ``curves`` to that
    stage's own (:attr:`trainers.catalog.StageSpec.curves`)."""
    runs = experiment_runs(experiment, selection)
    if not runs:
        raise ValueError(f"experiment {experiment!r} has no finished experiment runs to compare ({selection})")
    chosen = select_baseline(runs, baseline)
    fields = trained_fields([run.data.params for run in runs])
    differing = differing_params(fields)
    shown = params or differing[:MAX_VARYING_PARAMS]
    final = chosen.data.tags.get("alignflow.final_stage", "")
    stage = stage or curve_stage(logged_stages(chosen.data.params), differing, final)
    curves = curves or list(stage_curves(stage))
    summaries = [replace(summarize(run, curves, stage), params=used) for run, used in zip(runs, fields)]
    summaries = label_runs(summaries, shown)
    base = next(s for s in summaries if s.run_id == chosen.info.run_id)
    if metrics is None:
        measured = {m for summary in summaries for m in summary.metrics}
        suites = sorted(m for m in measured if is_suite_metric(m))
        metrics = [m for m in DEFAULT_METRICS if m in measured] + suites or DEFAULT_METRICS

    folder = get_settings().root / "comparisons" / experiment / time.strftime("%Y%m%d-%H%M%S")
    folder.mkdir(parents=True, exist_ok=True)
    rows = comparison_rows(summaries, base, shown, metrics)
    table = markdown_table(rows)
    (folder / "table.md").write_text(table)
    (folder / "table.json").write_text(json.dumps(rows, indent=2))
    plot_training_curves(summaries, curves, folder / "training_curves.png", stage)
    plot_eval_bars(summaries, metrics, folder / "eval_metrics.png")

    run = client().create_run(
        experiment_id(experiment),
        run_name="comparison",
        tags={"alignflow.kind": "comparison", "alignflow.baseline": base.run_id},
    )
    with tracked_run(run.info.run_id) as run_id:
        client().log_artifacts(run_id, str(folder))
    create_markdown_artifact(
        key="comparison",
        markdown=f"## {experiment}: {len(runs)} run{'s' * (len(runs) != 1)}, baseline {base.label}\n\n{table}\n"
        f"Plots `training_curves.png` and `eval_metrics.png`: the artifacts of the MLflow run "
        f"[comparison]({mlflow_run_url(run.info.experiment_id, run_id)}); local copies in `{folder}`.\n",
        description="alignflow comparison",
    )
    return ComparisonReport(
        folder=str(folder),
        table=table,
        baseline_run_id=base.run_id,
        run_ids=[s.run_id for s in summaries],
        mlflow_run_id=run_id,
        stage=stage,
        curves=curves,
    )
