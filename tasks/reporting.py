"""Comparison tables and plots of experiment runs (pure: no Prefect, no MLflow)."""

from __future__ import annotations

import math
import statistics
import textwrap
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")  # files only, never a display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

LEGEND_WIDTH = 70  # characters per legend line: the label of a run that differs in many settings wraps
LOG_AXIS_FACTOR = 10.0  # a training-curve panel whose runs lie further apart than this is drawn on a log axis


@dataclass(frozen=True)
class RunSummary:
    run_id: str
    name: str
    params: dict[str, str]
    metrics: dict[str, float]  # final evaluation metrics, with `<name>_ci_low` / `<name>_ci_high`
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # training metric -> (step, value)
    distinction: str = ""  # what sets it apart from the runs it is compared with (see `label_runs`)

    @property
    def label(self) -> str:
        """What a plot's legend calls it: what sets it apart, or its name, and its short id."""
        return f"{self.distinction or self.name} ({self.run_id[:8]})"

    @property
    def handle(self) -> str:
        """What a table calls it, where what sets it apart has columns of its own: its name and short id."""
        return f"{self.name} ({self.run_id[:8]})"


def label_runs(runs: list[RunSummary], params: list[str]) -> list[RunSummary]:
    """The runs, each labelled by its values of ``params`` (the fields that differ between them)."""
    return [replace(run, distinction=", ".join(f"{p}={run.params.get(p, '—')}" for p in params)) for run in runs]


def run_colours(runs: list[RunSummary]) -> dict[str, str]:
    """One colour per run, the same in every panel and plot."""
    return {run.run_id: f"C{index % 10}" for index, run in enumerate(runs)}


def comparison_rows(
    runs: list[RunSummary], baseline: RunSummary, params: list[str], metrics: list[str]
) -> list[dict[str, object]]:
    """One row per run: key params, each metric and its delta against the baseline."""
    rows = []
    for run in runs:
        row: dict[str, object] = {"run": run.handle, "baseline": "yes" if run.run_id == baseline.run_id else ""}
        row |= {p: run.params.get(p, "") for p in params}
        for m in metrics:
            value, reference = run.metrics.get(m, math.nan), baseline.metrics.get(m, math.nan)
            row[m] = value
            row[f"Δ {m}"] = value - reference
        rows.append(row)
    return rows


def markdown_table(rows: Sequence[Mapping[str, object]]) -> str:
    columns = list(rows[0])

    def cell(value: object) -> str:
        if isinstance(value, float):
            return "—" if math.isnan(value) else f"{value:.3f}"
        return str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def training_curves_figure(runs: list[RunSummary], metrics: list[str], stage: str) -> plt.Figure:
    """One panel per training metric of ``stage``, one line per run in its own colour, one legend of
    the runs drawn (a run that did not train ``stage`` has no line, nor a legend entry)."""
    colours = run_colours(runs)
    figure, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4.2), squeeze=False)
    for axis, metric in zip(axes[0], metrics):
        for run in runs:
            if points := run.curves.get(metric, []):
                steps, values = zip(*points)
                axis.plot(steps, values, marker=".", color=colours[run.run_id], label=run.label)
        if not axis.get_lines():
            axis.text(0.5, 0.5, f"not logged by {stage or 'this stage'}", ha="center", transform=axis.transAxes)
        if spread_apart([list(line.get_ydata()) for line in axis.get_lines()]):
            axis.set_yscale("log")
        axis.set_title(f"{stage}: {metric}" if stage else metric)
        axis.set_xlabel("optimizer step")
        axis.grid(alpha=0.3)
    figure.tight_layout()
    drawn = [run for run in runs if any(run.curves.get(metric) for metric in metrics)]
    if drawn:
        legend_below(figure, [plt.Line2D([], [], color=colours[run.run_id], marker=".") for run in drawn], drawn)
    return figure


def spread_apart(curves: list[list[float]], factor: float = LOG_AXIS_FACTOR) -> bool:
    """Whether the runs' curves lie more than ``factor`` apart (their medians), all positive: a
    linear axis would flatten all but the highest (IPO's loss, ~1/(2β)², beside the sigmoid loss's
    ~0.7 in a sweep over DPO losses), a log axis shows each."""
    if len(curves) < 2 or any(value <= 0 for curve in curves for value in curve):
        return False
    medians = [statistics.median(curve) for curve in curves]
    return max(medians) > factor * min(medians)


def legend_below(figure: plt.Figure, handles: list, runs: list[RunSummary]) -> None:
    """One legend for the figure, under its panels, a run's label wrapped at :data:`LEGEND_WIDTH`
    characters (the saved file grows to hold it: :func:`saved`)."""
    labels = [textwrap.fill(run.label, LEGEND_WIDTH) for run in runs]
    figure.legend(
        handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0), ncol=min(len(runs), 2), fontsize=7, frameon=False
    )


def saved(figure: plt.Figure, path: Path) -> Path:
    figure.savefig(path, dpi=110, bbox_inches="tight")  # the legend under the panels included
    plt.close(figure)
    return path


def plot_training_curves(runs: list[RunSummary], metrics: list[str], path: Path, stage: str = "") -> Path:
    return saved(training_curves_figure(runs, metrics, stage), path)


def eval_bars_figure(runs: list[RunSummary], metrics: list[str]) -> plt.Figure:
    """Grouped bars: final eval metrics per run, with 95% bootstrap intervals as error bars; a
    metric no run has (e.g. ``pass_at_4`` without 4 in ``evaluation.pass_k``) says so."""
    width, colours = 0.8 / len(runs), run_colours(runs)
    figure, axis = plt.subplots(figsize=(max(6, 2.2 * len(metrics)), 3.8))
    for index, run in enumerate(runs):
        values = [run.metrics.get(m, math.nan) for m in metrics]
        lower = [v - run.metrics.get(f"{m}_ci_low", v) for m, v in zip(metrics, values)]
        upper = [run.metrics.get(f"{m}_ci_high", v) - v for m, v in zip(metrics, values)]
        positions = [i + (index - (len(runs) - 1) / 2) * width for i in range(len(metrics))]
        axis.bar(positions, values, width, yerr=[lower, upper], capsize=3, color=colours[run.run_id])
    for position, metric in enumerate(metrics):
        if not any(metric in run.metrics for run in runs):
            axis.text(position, 0.5, "not measured", ha="center", color="grey")
    axis.set_xticks(range(len(metrics)), metrics)
    axis.set_xlim(-0.5, len(metrics) - 0.5)  # every group gets its slot, a bar-less one too
    axis.set_ylim(0, 1.05)
    axis.set_ylabel("held-out score (95% CI)")
    axis.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    legend_below(figure, [Patch(color=colours[run.run_id]) for run in runs], runs)
    return figure


def plot_eval_bars(runs: list[RunSummary], metrics: list[str], path: Path) -> Path:
    return saved(eval_bars_figure(runs, metrics), path)


def mean_and_sd(values: list[float]) -> tuple[float, float]:
    """Mean ``x̄ = Σx / n`` and sample standard deviation ``sd = √(Σ(x − x̄)² / (n − 1))``
    (NaN for a single value: one seed says nothing about the spread)."""
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in values) / (n - 1)) if n > 1 else math.nan
    return mean, sd


def is_interval_end(metric: str) -> bool:
    return metric.endswith(("_ci_low", "_ci_high"))


def seed_aggregates(
    trials: list[tuple[dict[str, object], dict[str, float]]], seed_key: str = "seed"
) -> list[dict[str, object]]:
    """One row per distinct config, ``(params, metrics)`` of its trials grouped by their params
    without ``seed_key``, in order of first appearance: the params, ``seeds`` (the number of
    trials) and, for every metric any of them has (interval ends left out), ``(mean, sd)`` over the
    trials that have it (:func:`mean_and_sd`)."""
    groups: dict[tuple, list[tuple[dict, dict]]] = {}
    for params, metrics in trials:
        config = {key: value for key, value in params.items() if key != seed_key}
        groups.setdefault(tuple(sorted((k, repr(v)) for k, v in config.items())), []).append((config, metrics))
    names = sorted({m for _, metrics in trials for m in metrics if not is_interval_end(m)})
    rows = []
    for members in groups.values():
        row: dict[str, object] = dict(members[0][0]) | {"seeds": len(members)}
        for name in names:
            values = [metrics[name] for _, metrics in members if name in metrics]
            row[name] = mean_and_sd(values) if values else (math.nan, math.nan)
        rows.append(row)
    return rows


def mean_sd_cell(value: object) -> object:
    """``0.512 ± 0.031`` for a (mean, sd) pair; ``0.512 ± —`` for one seed; other values unchanged."""
    if isinstance(value, tuple):
        mean, sd = value
        return f"{mean:.3f} ± {'—' if math.isnan(sd) else f'{sd:.3f}'}"
    return value


def seed_table_markdown(rows: list[dict[str, object]]) -> str:
    return markdown_table([{key: mean_sd_cell(value) for key, value in row.items()} for row in rows])
