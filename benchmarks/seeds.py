"""The default experiment over seeds and floating-point kernel paths (issue 15): a seed sweep
(``configs/seeds.yaml``) per kernel path, each in its own state folder, then per path the
per-seed table and the mean ± sd per stage, the same pooled over every path, and the bar of the
default experiment's story.

    .venv/bin/python benchmarks/seeds.py                          # both paths: ~30 min on 2 free cores
    .venv/bin/python benchmarks/seeds.py --report-only            # the tables of the sweeps already run
    .venv/bin/python benchmarks/seeds.py --name rpo base.dpo.loss_type=[sigmoid,sft]   # a variant

A kernel path is what picks torch's CPU kernels: ``native`` (this CPU's best, AVX-512 here) and
``avx2`` (``ATEN_CPU_CAPABILITY=avx2``, what an AVX2-only machine runs), one torch thread per trial
(the sweep's ``torch_threads``), two trials at once; ``2-threads``: native kernels, two torch
threads, one trial at a time (what ``make run`` does on a 2-core machine). The state folders are
``--root``/``<path>``, so SFT and the reference pass are shared by the variants of one path (Prefect's
cache) and never across paths. Figures are MLflow's ``eval/<stage>/<metric>`` of each trial.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

from mlflow import MlflowClient

from infra.core.settings import Settings

# path -> (environment, sweep overrides)
KERNEL_PATHS = {
    "native": ({}, []),
    "avx2": ({"ATEN_CPU_CAPABILITY": "avx2"}, []),
    "2-threads": ({}, ["torch_threads=2", "workers=1", "max_concurrent=1"]),
}
METRICS = ("greedy_accuracy", "sampled_accuracy", "pass_at_4")
STAGES = ("sft", "dpo", "grpo")
Trial = dict[tuple[str, str], float]  # (stage, metric) -> value


def run_sweep(config: str, name: str, overrides: list[str], home: Path, path: str) -> None:
    kernel, path_overrides = KERNEL_PATHS[path]
    environment = {key: value for key, value in os.environ.items() if key != "ATEN_CPU_CAPABILITY"}
    environment |= {"ALIGNFLOW_HOME": str(home), **kernel}
    alignflow = str(Path(sys.executable).with_name("alignflow"))
    command = [alignflow, "sweep", config, f"name={name}", *path_overrides, *overrides]
    print(f"$ {' '.join(f'{k}={v}' for k, v in kernel.items())} ALIGNFLOW_HOME={home} {' '.join(command)}", flush=True)
    subprocess.run(command, env=environment, check=True)


def sweep_trials(home: Path, name: str) -> dict[int, Trial]:
    """The newest sweep run called ``name`` in the state folder: its trials' figures by seed."""
    client = MlflowClient(Settings(home=home).mlflow_tracking_uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    query = f"tags.`alignflow.kind` = 'sweep' and attributes.run_name = '{name}'"
    sweeps = client.search_runs(experiments, query, order_by=["attributes.start_time DESC"], max_results=1)
    if not sweeps:
        raise SystemExit(f"{home}: no sweep run named {name!r}; run it first (without --report-only)")
    trials = client.search_runs(experiments, f"tags.mlflow.parentRunId = '{sweeps[0].info.run_id}'")
    return {
        int(run.data.params["seed"]): {
            (stage, metric): run.data.metrics[f"eval/{stage}/{metric}"] for stage in STAGES for metric in METRICS
        }
        for run in trials
    }


def mean_sd(values: list[float]) -> str:
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {spread:.3f}"


def change(trial: Trial, stage: str, metric: str) -> float:
    """The stage's ``metric`` minus the stage before's."""
    return trial[stage, metric] - trial[STAGES[STAGES.index(stage) - 1], metric]


def sampled_gain(trial: Trial, stage: str) -> float:
    return change(trial, stage, "sampled_accuracy")


def greedy_change(trials: list[Trial], stage: str) -> float:
    """The stage's mean greedy accuracy minus the stage before's, over the trials."""
    return statistics.mean(change(t, stage, "greedy_accuracy") for t in trials)


def print_aggregate(trials: list[Trial]) -> None:
    print("| stage | " + " | ".join(METRICS) + " |\n" + "|---" * (len(METRICS) + 1) + "|")
    for stage in STAGES:
        print(f"| {stage} | " + " | ".join(mean_sd([t[stage, metric] for t in trials]) for metric in METRICS) + " |")
    print()


def print_seeds(trials: dict[int, Trial]) -> None:
    header = " | ".join(f"{stage} greedy / sampled" for stage in STAGES)
    gains = "DPO − SFT sampled | GRPO − DPO sampled | DPO − SFT greedy | GRPO − DPO greedy"
    print(f"| seed | {header} | {gains} |\n" + "|---" * (len(STAGES) + 5) + "|")
    for seed, trial in sorted(trials.items()):
        cells = " | ".join(f"{trial[s, 'greedy_accuracy']:.3f} / {trial[s, 'sampled_accuracy']:.3f}" for s in STAGES)
        changes = [
            change(trial, stage, metric) for metric in ("sampled_accuracy", "greedy_accuracy") for stage in STAGES[1:]
        ]
        print(f"| {seed} | {cells} | " + " | ".join(f"{value:+.3f}" for value in changes) + " |")
    print()


def bar(trials: list[Trial]) -> dict[str, bool]:
    """The story's four conditions over these trials (means over them; the last one per trial)."""
    return {
        "DPO gains >= +5 points of sampled accuracy over SFT (mean)": statistics.mean(
            sampled_gain(t, "dpo") for t in trials
        )
        >= 0.05,
        "GRPO gains >= +5 points of sampled accuracy over DPO (mean)": statistics.mean(
            sampled_gain(t, "grpo") for t in trials
        )
        >= 0.05,
        "no stage lowers greedy accuracy by more than 1 point (mean)": min(
            greedy_change(trials, stage) for stage in STAGES[1:]
        )
        >= -0.01,
        "every seed: positive DPO and GRPO sampled gains": all(
            sampled_gain(t, stage) > 0 for t in trials for stage in STAGES[1:]
        ),
    }


def print_bar(label: str, trials: list[Trial]) -> bool:
    changes = ", ".join(f"{stage} {greedy_change(trials, stage) * 100:+.1f}" for stage in STAGES[1:])
    print(f"{label}: greedy change per stage (points, mean): {changes}")
    checks = bar(trials)
    for check, holds in checks.items():
        print(f"  {'holds' if holds else 'FAILS'}: {check}")
    print()
    return all(checks.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="sweep overrides (base.<key>=value for the experiment)")
    parser.add_argument("--config", default="configs/seeds.yaml")
    parser.add_argument("--name", default="default-seeds", help="the sweep's name (its MLflow run)")
    parser.add_argument("--paths", nargs="+", choices=list(KERNEL_PATHS), default=["native", "avx2"])
    parser.add_argument("--root", type=Path, default=Path(".alignflow/seed-study"))
    parser.add_argument("--report-only", action="store_true", help="read the sweeps already run; run nothing")
    args = parser.parse_args()
    by_path = {}
    for path in args.paths:
        home = (args.root / path).resolve()
        if not args.report_only:
            run_sweep(args.config, args.name, args.overrides, home, path)
        by_path[path] = sweep_trials(home, args.name)
    print(f"\nsweep {args.name!r} ({args.config} {' '.join(args.overrides)}), kernel paths {', '.join(args.paths)}\n")
    for path, trials in by_path.items():
        print(f"### kernel path {path}: {len(trials)} seeds\n")
        print_seeds(trials)
        print_aggregate(list(trials.values()))
    pooled = [trial for trials in by_path.values() for trial in trials.values()]
    print(f"### pooled: {len(pooled)} trials ({len(by_path)} paths × seeds)\n")
    print_aggregate(pooled)
    verdicts = [print_bar(f"path {path}", list(trials.values())) for path, trials in by_path.items()]
    verdicts.append(print_bar("pooled", pooled))
    print("the bar holds on every path" if all(verdicts) else "the bar FAILS somewhere (above)")


if __name__ == "__main__":
    main()
