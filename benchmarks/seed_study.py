"""Per-stage accuracy over the seeds of a sweep (e.g. ``configs/seeds.yaml``): every trial's
``eval/<stage>/<metric>``, the mean ± sd per stage, each seed's gains from stage to stage, and
the bar of the default experiment's story (each stage's sampled gain, no stage losing more than
a point of greedy accuracy).

    .venv/bin/alignflow sweep configs/seeds.yaml           # the sweep first
    .venv/bin/python benchmarks/seed_study.py              # its newest sweep run in this state folder
    .venv/bin/python benchmarks/seed_study.py --sweep-run RUN_ID
"""

from __future__ import annotations

import argparse
import statistics

from mlflow import MlflowClient

from infra.settings import configure_environment

METRICS = ("greedy_accuracy", "sampled_accuracy", "pass_at_4")
STAGES = ("sft", "dpo", "grpo")


def mean_sd(values: list[float]) -> str:
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {spread:.3f}"


def trials_of(client: MlflowClient, sweep_run_id: str | None) -> tuple[str, list]:
    experiments = [e.experiment_id for e in client.search_experiments()]
    if sweep_run_id is None:
        (sweep,) = client.search_runs(experiments, "tags.`alignflow.kind` = 'sweep'", max_results=1)
        sweep_run_id = sweep.info.run_id
    trials = client.search_runs(experiments, f"tags.mlflow.parentRunId = '{sweep_run_id}'")
    return sweep_run_id, sorted(trials, key=lambda run: int(run.data.params.get("seed", 0)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep-run", help="the sweep's MLflow run id (default: the newest sweep run)")
    args = parser.parse_args()
    client = MlflowClient(configure_environment().mlflow_tracking_uri)
    sweep_run_id, trials = trials_of(client, args.sweep_run)
    value = {
        (run.data.params.get("seed"), stage, metric): run.data.metrics.get(f"eval/{stage}/{metric}")
        for run in trials
        for stage in STAGES
        for metric in METRICS
    }
    seeds = [run.data.params.get("seed") for run in trials]
    print(f"sweep run {sweep_run_id}: {len(trials)} trials, seeds {', '.join(map(str, seeds))}\n")
    print("| stage | " + " | ".join(METRICS) + " |\n" + "|---" * (len(METRICS) + 1) + "|")
    for stage in STAGES:
        cells = [mean_sd([value[seed, stage, metric] for seed in seeds]) for metric in METRICS]
        print(f"| {stage} | " + " | ".join(cells) + " |")
    print(
        "\n| seed | " + " | ".join(f"{s} greedy / sampled" for s in STAGES) + " | DPO − SFT sampled | GRPO − DPO "
        "sampled | worst greedy change |"
    )
    print("|---" * (len(STAGES) + 4) + "|")
    gains = {"dpo": [], "grpo": []}
    worst_greedy = []
    for seed in seeds:
        cells = [f"{value[seed, s, 'greedy_accuracy']:.3f} / {value[seed, s, 'sampled_accuracy']:.3f}" for s in STAGES]
        for earlier, later in zip(STAGES, STAGES[1:]):
            gains[later].append(value[seed, later, "sampled_accuracy"] - value[seed, earlier, "sampled_accuracy"])
        greedy = [value[seed, s, "greedy_accuracy"] for s in STAGES]
        worst_greedy.append(min(b - a for a, b in zip(greedy, greedy[1:])))
        print(
            f"| {seed} | " + " | ".join(cells) + f" | {gains['dpo'][-1]:+.3f} | {gains['grpo'][-1]:+.3f} | "
            f"{worst_greedy[-1]:+.3f} |"
        )
    checks = {
        "DPO gains >= +5 points sampled over SFT (mean)": statistics.mean(gains["dpo"]) >= 0.05,
        "GRPO gains >= +5 points sampled over DPO (mean)": statistics.mean(gains["grpo"]) >= 0.05,
        "no stage lowers greedy accuracy by more than 1 point (mean)": statistics.mean(worst_greedy) >= -0.01,
        "every seed: positive DPO and GRPO sampled gains": all(g > 0 for g in gains["dpo"] + gains["grpo"]),
    }
    print()
    for check, holds in checks.items():
        print(f"{'holds' if holds else 'FAILS'}: {check}")


if __name__ == "__main__":
    main()
