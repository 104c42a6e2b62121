"""Fixed cost of ``alignflow run``: where the wall time of a small run goes, cold, warm and changed.

Runs ``alignflow run configs/minimal.yaml`` three times in a fresh ``ALIGNFLOW_HOME`` (cold: empty
state folder, nothing cached; warm: the same command again; changed: the command with
``--changed`` overrides, by default a DPO learning rate, so DPO and GRPO train again on the warm
folder) with the embedded default (temporary Prefect API on SQLite, MLflow on SQLite) and splits
each run's wall time by the timestamps the Prefect database keeps (read from
``$ALIGNFLOW_HOME/prefect/prefect.db`` after the run):

* **start-up**: process start → the flow run starts (Python, imports, config checks, temporary
  Prefect server start-up; they overlap where alignflow overlaps them);
* **tasks**: the sum of task-run durations; **between tasks**: the rest of the flow run;
* **shutdown**: the flow run ends → the process has exited (server stop, interpreter exit).

Also measured alone: ``import flows.pipeline`` in a fresh interpreter.

    .venv/bin/python benchmarks/overhead.py [--config configs/minimal.yaml] [--repeat 1] [--changed key=value ...]
"""

from __future__ import annotations

import argparse
import os
import re
import sqlite3
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT / "tests"))

from helpers import environment_without_services  # noqa: E402


def parse_time(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def prefect_timeline(home: Path) -> tuple[float, float, dict[str, float]]:
    """The newest flow run's start and end, and its task runs' durations by name."""
    with sqlite3.connect(home / "prefect" / "prefect.db") as db:
        flow_id, start, end = db.execute(
            "SELECT id, start_time, end_time FROM flow_run ORDER BY created DESC LIMIT 1"
        ).fetchone()
        tasks = db.execute(
            "SELECT name, start_time, end_time FROM task_run WHERE flow_run_id = ? AND start_time IS NOT NULL",
            (flow_id,),
        ).fetchall()
    durations: dict[str, float] = {}
    for name, begin, stop in tasks:  # names like evaluate-3f1: the suffix is random
        base = re.sub(r"-[0-9a-f]{3}$", "", name)
        durations[base] = durations.get(base, 0.0) + parse_time(stop) - parse_time(begin)
    return parse_time(start), parse_time(end), durations


def timed_run(home: Path, config: str, overrides: list[str] = ()) -> dict[str, float]:
    env = environment_without_services() | {"ALIGNFLOW_HOME": str(home)}
    began = time.time()
    command = [sys.executable, "-m", "infra.ops.cli", "run", config, *overrides]
    result = subprocess.run(command, cwd=PROJECT, env=env, capture_output=True, text=True)
    ended = time.time()
    if result.returncode != 0:
        raise SystemExit(f"alignflow run failed:\n{result.stderr[-3000:]}")
    flow_start, flow_end, tasks = prefect_timeline(home)
    task_total = sum(tasks.values())
    return {
        "wall": ended - began,
        "start-up": flow_start - began,
        "tasks": task_total,
        "between tasks": (flow_end - flow_start) - task_total,
        "shutdown": ended - flow_end,
        **{f"  {name}": seconds for name, seconds in sorted(tasks.items())},
    }


def import_seconds() -> float:
    began = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import flows.pipeline"], cwd=PROJECT, check=True)
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/minimal.yaml")
    parser.add_argument("--repeat", type=int, default=1, help="runs of the three, each in a fresh folder")
    parser.add_argument(
        "--changed", nargs="*", default=["dpo.learning_rate=0.002"], help="overrides of the third run (none: skip it)"
    )
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}; cores: {os.cpu_count()}; config: {args.config}")
    print(f"import flows.pipeline (fresh interpreter): {import_seconds():.2f} s")
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory(prefix="alignflow-overhead-") as folder:
            runs = {"cold": timed_run(Path(folder), args.config), "warm": timed_run(Path(folder), args.config)}
            if args.changed:
                runs["changed"] = timed_run(Path(folder), args.config, args.changed)
        print("\n| phase | " + " | ".join(f"{name} (s)" for name in runs) + " |\n" + "|---" * (len(runs) + 1) + "|")
        for phase in dict.fromkeys(phase for run in runs.values() for phase in run):
            print(f"| {phase} | " + " | ".join(f"{run.get(phase, 0.0):.2f}" for run in runs.values()) + " |")
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
