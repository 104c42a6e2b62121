"""GRPO's generation backends on the built-in task (issue 28): the default experiment's SFT and GRPO
stages, trained once with ``grpo.generation_backend=hf``, once with ``vllm`` colocated and once with
a managed vLLM server (``vllm_mode=server``), then the hf-trained model evaluated again with
``evaluation.generation_backend=vllm``; all in one state folder, so SFT comes from the cache (GRPO is
not a cached stage: the last run trains it again, to the same curve).

    .venv-vllm/bin/python benchmarks/grpo_backends.py            # ~8 min on 2 free cores
    .venv-vllm/bin/python benchmarks/grpo_backends.py --only train-vllm --only train-vllm-server
    .venv-vllm/bin/python benchmarks/grpo_backends.py --report-only

Prints per run: the wall time, GRPO's optimizer steps and its reward curve (the logged windows), its
generation seconds per step, and the final model's greedy and sampled accuracy with their bootstrap
intervals and the evaluation's wall time.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from mlflow import MlflowClient

from infra.core.settings import Settings

# run name -> overrides of configs/default.yaml
RUNS = {
    "train-hf": ["grpo.generation_backend=hf"],
    "train-vllm": ["grpo.generation_backend=vllm"],
    "train-vllm-server": ["grpo.generation_backend=vllm", "grpo.vllm_mode=server"],
    "train-hf-eval-vllm": ["grpo.generation_backend=hf", "evaluation.generation_backend=vllm"],
}


def run(home: Path, name: str, overrides: list[str]) -> float:
    alignflow = str(Path(sys.executable).with_name("alignflow"))
    command = [alignflow, "run", "configs/default.yaml", "stages=[sft,grpo]", f"name={name}", *overrides]
    print(f"$ ALIGNFLOW_HOME={home} {' '.join(command)}", flush=True)
    started = time.perf_counter()
    subprocess.run(command, env=os.environ | {"ALIGNFLOW_HOME": str(home)}, check=True)
    return time.perf_counter() - started


def report(home: Path, name: str, wall: float | None) -> None:
    client = MlflowClient(Settings(home=home).mlflow_tracking_uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    (parent,) = client.search_runs(
        experiments, f"attributes.run_name = '{name}'", order_by=["attributes.start_time DESC"], max_results=1
    )
    children = {
        child.info.run_name: child
        for child in client.search_runs(experiments, f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    }
    grpo, evaluation = children["grpo"], children["evaluate"]
    curve = client.get_metric_history(grpo.info.run_id, "reward")
    generation = client.get_metric_history(grpo.info.run_id, "time/generation_per_step")
    metrics = parent.data.metrics
    eval_seconds = (evaluation.info.end_time - evaluation.info.start_time) / 1000
    print(f"\n## {name}" + (f" ({wall:.0f} s wall)" if wall else ""))
    print(f"GRPO: {max(point.step for point in curve)} optimizer steps; reward by step:")
    print("  " + ", ".join(f"{point.step}: {point.value:.3f}" for point in sorted(curve, key=lambda p: p.step)))
    print(f"  generation s / step: {', '.join(f'{point.value:.3f}' for point in generation)}")
    for metric in ("greedy_accuracy", "sampled_accuracy"):
        value, low, high = (metrics[f"eval/grpo/{metric}{suffix}"] for suffix in ("", "_ci_low", "_ci_high"))
        print(f"  final {metric}: {value:.3f} [{low:.3f}, {high:.3f}]")
    print(f"  evaluation (every model of the run): {eval_seconds:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--home", type=Path, default=Path("/tmp/alignflow-grpo-backends"))
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--only", choices=sorted(RUNS), action="append", help="these runs (default: all)")
    options = parser.parse_args()
    names = options.only or list(RUNS)
    walls = {name: None if options.report_only else run(options.home, name, RUNS[name]) for name in names}
    for name, wall in walls.items():
        report(options.home, name, wall)


if __name__ == "__main__":
    main()
