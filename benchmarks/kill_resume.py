"""kill -9 at random points, 3 times per stage, each followed by the identical rerun (issue 11's acceptance).

    .venv/bin/python benchmarks/kill_resume.py [--kills 3] [--seed 0] [--chain default|toolbox] [--stages …] [--keep]

Each trial starts a real ``alignflow run`` of the kill-test config (``tests/killing.py``) in a
fresh state folder, SIGKILLs its process group once the stage has a random number of complete
checkpoints plus a random delay (so some kills land while a checkpoint is being written), reruns
it identically and compares with one uninterrupted run: the largest weight difference of every
stage's final model, metric steps logged more than once in the killed stage's MLflow run,
metrics whose steps or values differ from the uninterrupted run, whether the stages that had
finished were reused untouched, and the MLflow runs left RUNNING (the killed attempt's parent run
stays RUNNING until ``alignflow runs cleanup`` marks it). One temporary Prefect server serves
every run. Prints a Markdown table; exit 1 if a trial failed.
"""

from __future__ import annotations

import argparse
import atexit
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
# this process's own state folder (the Prefect test server's); every run gets one of its own below
OWN_HOME = tempfile.mkdtemp(prefix="alignflow-bench-kill-")
os.environ["ALIGNFLOW_HOME"] = OWN_HOME

from infra.core.settings import configure_environment  # noqa: E402

configure_environment()

from killing import (  # noqa: E402
    STAGES,
    TOOLBOX,
    Kill,
    compare_metrics,
    duplicate_steps,
    max_weight_difference,
    metric_histories,
    mlflow_client,
    run,
    run_and_kill,
    stage_run_tags,
    stage_snapshot,
    write_config,
)

# The kill-test config's checkpoint steps at which a kill may be armed (the last one or two would
# leave the stage too little time to be killed before it finishes).
KILL_AFTER = {"sft": [3, 6, 9, 12, 15, 18], "dpo": [3, 6, 9, 12, 15, 18], "grpo": [3, 6, 9, 12]}
KILL_AFTER |= {stage: [3, 6, 9, 12, 15, 18] for stage in ("kto", "reward", "distill")}
# `--chain toolbox` runs the kill-test config with `stages=[sft, reward, kto, distill]`.
CHAINS = {"default": STAGES, "toolbox": TOOLBOX}


def running_runs(home: Path) -> int:
    client = mlflow_client(home)
    experiment = client.get_experiment_by_name("alignflow")
    return len(client.search_runs([experiment.experiment_id], "attributes.status = 'RUNNING'"))


def trial(config: Path, home: Path, reference: Path, api: str, kill: Kill, chain: tuple[str, ...]) -> dict:
    overrides = chain_overrides(chain)
    run_and_kill(config, home, api, kill, overrides)
    earlier = chain[: chain.index(kill.stage)]
    before = {name: stage_snapshot(home, name) for name in earlier}
    started = time.monotonic()
    run(config, home, api, overrides)
    histories = metric_histories(home, kill.stage)
    tags = stage_run_tags(home, kill.stage)
    return {
        "stage": kill.stage,
        "kill after": f"ckpt {kill.after_step} + {kill.delay:.2f} s",
        "killed at (s)": f"{kill.seconds:.1f}",
        "complete ckpts": ",".join(map(str, kill.checkpoints_at_kill)),
        "resumed from": tags.get("alignflow.resumed_from_step", "-"),
        "max |Δw|": f"{max(max_weight_difference(home, reference, name) for name in chain):.1e}",
        "dup. steps": len(duplicate_steps(histories)),
        "metric diffs": len(compare_metrics(histories, metric_histories(reference, kill.stage))),
        "earlier reused": all(stage_snapshot(home, name) == before[name] for name in earlier),
        "RUNNING left": running_runs(home),
        "rerun (s)": f"{time.monotonic() - started:.1f}",
    }


def chain_overrides(chain: tuple[str, ...]) -> list[str]:
    return [] if chain == STAGES else [f"stages=[{', '.join(chain)}]"]


def passed(row: dict) -> bool:
    exact = float(row["max |Δw|"]) <= 1e-6 and row["dup. steps"] == 0 and row["metric diffs"] == 0
    return exact and row["earlier reused"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=3, help="kills per stage")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chain", default="default", choices=sorted(CHAINS), help="the stages the runs train")
    parser.add_argument(
        "--stages", nargs="+", choices=sorted(KILL_AFTER), help="the chain's stages to kill (default all)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the state folders (printed) for inspection")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    chain = CHAINS[args.chain]
    stages = args.stages or list(chain)
    if not set(stages) <= set(chain):
        parser.error(f"--stages {stages}: the {args.chain} chain trains {list(chain)}")

    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    work = Path(tempfile.mkdtemp(prefix="alignflow-kill-"))
    if args.keep:
        print(f"state folders: {work}", flush=True)
    else:
        atexit.register(shutil.rmtree, work, ignore_errors=True)
        atexit.register(shutil.rmtree, OWN_HOME, ignore_errors=True)
    config = write_config(work)
    rows = []
    with prefect_test_harness(server_startup_timeout=120):
        api = PREFECT_API_URL.value()
        started = time.monotonic()
        run(config, work / "uninterrupted", api, chain_overrides(chain))
        print(f"uninterrupted run: {time.monotonic() - started:.1f} s", flush=True)
        for stage in stages:
            for index in range(args.kills):
                kill = Kill(stage, after_step=rng.choice(KILL_AFTER[stage]), delay=rng.uniform(0, 0.3))
                try:
                    row = trial(config, work / f"{stage}-{index}", work / "uninterrupted", api, kill, chain)
                except AssertionError as error:
                    row = {"stage": stage, "kill after": f"ckpt {kill.after_step}", "error": str(error)[:200]}
                row["ok"] = "error" not in row and passed(row)
                rows.append(row)
                print(row, flush=True)
    columns = list(dict.fromkeys(key for row in rows for key in row))
    print("\n| " + " | ".join(columns) + " |\n|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(str(row.get(column, "")) for column in columns) + " |")
    return 0 if all(row["ok"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
