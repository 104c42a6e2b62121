"""Comparison flow: one table and two plots over an experiment's runs, logged to MLflow and Prefect."""

from __future__ import annotations

from prefect import flow

from tasks.compare import ComparisonReport, RunSelection, compare_runs


@flow(name="alignflow-compare", log_prints=True)
def compare(
    experiment: str = "alignflow",
    baseline: str | None = None,
    metrics: list[str] | None = None,
    curves: list[str] | None = None,
    params: list[str] | None = None,
    stage: str | None = None,
    filter: str | None = None,
    runs: list[str] | None = None,
    last: int | None = None,
) -> ComparisonReport:
    """Compare finished runs of ``experiment`` against ``baseline`` (run id, run name or key=value
    tag; default: the oldest). ``metrics`` default to the usual accuracy metrics the runs measured;
    ``params`` to the config fields that differ between runs; ``stage``, whose training curves are
    plotted, to the first stage whose settings differ, and ``curves`` to those that stage names. The
    runs: all finished ones, or those matching the MLflow search ``filter``, named in ``runs``, the
    ``last`` N."""
    selection = RunSelection(filter=filter, runs=tuple(runs or ()), last=last)
    report = compare_runs(experiment, baseline, metrics, curves, params, stage, selection)
    print(f"{report.table}\nPlots and table: {report.folder}")
    return report
