"""A 4-trial sweep on 2 Dask workers against the same 4 trials one after another (1 worker).

    .venv/bin/python benchmarks/sweep.py [--sweep configs/sweep.yaml] [override ...]

Each mode runs ``alignflow sweep`` machinery in a fresh process with its own empty ALIGNFLOW_HOME
(cold caches in both: SFT and the reference pass are computed once per mode, by whichever trial
gets there first) and its own temporary Prefect server. Reported per mode, from the Prefect API:

* wall: the sweep flow run, start to end;
* start-up: sweep start to the first trial's experiment flow run (cluster, worker imports);
* busy: the sum of the trials' experiment flow runs' durations;
* utilisation: busy / (workers × span), span = first trial start to last trial end;
* where the trials' time goes: the sum of each task's run time over the trials, by task name.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = {"parallel": ["workers=2", "max_concurrent=2"], "sequential": ["workers=1", "max_concurrent=1"]}


def measure(sweep_file: str, overrides: list[str], out: Path) -> None:
    """Run one sweep in this process and write its figures to ``out`` (JSON)."""
    from infra.core.settings import configure_environment

    configure_environment()
    from infra.core.config import load_config
    from infra.core.sweep import SweepConfig, read_sweep_tree
    from infra.ops.prefect_api import shared_prefect_api

    spec = load_config(sweep_file, overrides, SweepConfig, reader=read_sweep_tree)
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from flows.sweep import sweep

    with shared_prefect_api():
        state = sweep(spec, return_state=True)
        report = state.result()
        with get_client(sync_client=True) as client:
            (flow_run,) = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
            )
            ids = [t.flow_run_id for t in report.trials]
            trials = client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)))
            tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)))
    by_task: dict[str, float] = defaultdict(float)
    for run in tasks:  # task run names carry a suffix per run (`evaluate-3f2`), except the train-<stage> ones
        by_task[run.name if run.name.startswith("train-") else run.name.rsplit("-", 1)[0]] += (
            run.total_run_time.total_seconds()
        )
    first, last = min(t.start_time for t in trials), max(t.end_time for t in trials)
    figures = {
        "workers": spec.workers if spec.address is None else None,
        "trials": len(trials),
        "failed": [t.number for t in report.trials if t.status != "completed"],
        "wall": (flow_run.end_time - flow_run.start_time).total_seconds(),
        "startup": (first - flow_run.start_time).total_seconds(),
        "span": (last - first).total_seconds(),
        "busy": sum((t.end_time - t.start_time).total_seconds() for t in trials),
        "tasks": dict(sorted(by_task.items())),
    }
    out.write_text(json.dumps(figures, indent=2))


def run_mode(mode: str, sweep_file: str, overrides: list[str]) -> dict:
    home = Path(tempfile.mkdtemp(prefix=f"alignflow-bench-sweep-{mode}-"))
    out = home / "figures.json"
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
    env |= {"ALIGNFLOW_HOME": str(home), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, __file__, "--measure", str(out), "--sweep", sweep_file, *MODES[mode], *overrides]
    started = time.perf_counter()
    subprocess.run(command, env=env, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    figures = json.loads(out.read_text()) | {"process": time.perf_counter() - started}
    subprocess.run(["rm", "-rf", str(home)], check=False)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", default="configs/sweep.yaml")
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)  # one mode, in this process
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.measure:
        measure(args.sweep, args.overrides, args.measure)
        return
    load = os.getloadavg()
    results = {mode: run_mode(mode, args.sweep, args.overrides) for mode in MODES}
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores")
    print("| mode | workers | wall s | start-up s | trials span s | busy s | utilisation | process s |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, r in results.items():
        utilisation = r["busy"] / (r["workers"] * r["span"])
        print(
            f"| {mode} | {r['workers']} | {r['wall']:.1f} | {r['startup']:.1f} | {r['span']:.1f} | {r['busy']:.1f} | "
            f"{utilisation:.0%} | {r['process']:.1f} |"
        )
    parallel, sequential = results["parallel"], results["sequential"]
    print(f"\nwall ratio sequential / parallel: {sequential['wall'] / parallel['wall']:.2f}")
    print(f"trial-span ratio: {sequential['span'] / parallel['span']:.2f}")
    print("\ntask time summed over the trials (s):")
    for name in sorted(set(parallel["tasks"]) | set(sequential["tasks"])):
        times = (parallel["tasks"].get(name, 0.0), sequential["tasks"].get(name, 0.0))
        print(f"  {name:28s} parallel {times[0]:7.1f}   sequential {times[1]:7.1f}")


if __name__ == "__main__":
    main()
