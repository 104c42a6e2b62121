"""MLflow behind ``alignflow servers up --auth``: what checking the password costs, with MLflow's cache
of verified credentials off (MLflow's default) and on (what ``servers up --auth`` sets).

Each round starts, for each arm in turn, the authenticated tracking server as ``servers up --auth``
does (``infra.ops.servers.mlflow_server``, SQLite in a fresh folder, one worker), then

1. sends ``--requests`` authenticated calls (search experiments), one after another, and times them;
2. runs a small tracked experiment, ``alignflow run configs/minimal.yaml stages=[sft] sft.max_steps=2
   evaluation.num_prompts=4`` (on its own temporary Prefect server), and times it;

and reports, for each part, the wall time and the CPU seconds of the server's process group (from
/proc). Run it alone: the arms share the machine's cores with nothing else.

    .venv/bin/python benchmarks/mlflow_auth.py [--requests 50] [--rounds 2]
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from infra.core.mlflow_compat import basic_auth_config
from infra.core.ports import free_port
from infra.core.processes import group_members
from infra.ops import servers

PROJECT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT / "tests"))

from helpers import environment_without_services  # noqa: E402

RUN = ["run", "configs/minimal.yaml", "stages=[sft]", "sft.max_steps=2", "evaluation.num_prompts=4"]
ARMS = {"cache off (MLflow's default)": 0, f"cache on ({servers.MLFLOW_AUTH_CACHE_S} s)": servers.MLFLOW_AUTH_CACHE_S}


def group_cpu_seconds(pgid: int) -> float:
    """User and system CPU of the live processes of group ``pgid``."""
    return sum(member.cpu_ticks for member in group_members(pgid) or []) / os.sysconf("SC_CLK_TCK")


def measure(cache_seconds: int, requests: int, folder: Path) -> dict[str, float]:
    credentials = servers.Credentials.generate()
    options = servers.ServerOptions(mlflow_port=free_port(), credentials=credentials)
    spec = servers.mlflow_server(options, folder)
    spec = dataclasses.replace(spec, files={servers.MLFLOW_AUTH_CONFIG_FILE: basic_auth_config(cache_seconds)})
    pgid = servers.start(spec, folder)
    try:
        if servers.wait_healthy({"mlflow": spec}, {"mlflow": folder}, servers.HEALTH_TIMEOUT_S):
            raise RuntimeError(servers.log_tail(folder))
        login = f"{credentials.mlflow_username}:{credentials.mlflow_password}".encode()
        request = urllib.request.Request(
            f"{spec.url}/api/2.0/mlflow/experiments/search?max_results=1",
            headers={"Authorization": f"Basic {base64.b64encode(login).decode()}"},
        )
        cpu, began = group_cpu_seconds(pgid), time.perf_counter()
        for _ in range(requests):
            with urllib.request.urlopen(request, timeout=60) as answer:
                assert answer.status == 200
        figures = {"requests_s": time.perf_counter() - began, "requests_cpu": group_cpu_seconds(pgid) - cpu}
        env = environment_without_services("ALIGNFLOW_") | {
            "ALIGNFLOW_HOME": str(folder / "home"),
            "MLFLOW_TRACKING_URI": spec.url,
            "OMP_NUM_THREADS": "1",
        }
        env |= credentials.client_environment("mlflow")
        cpu, began = group_cpu_seconds(pgid), time.perf_counter()
        run = subprocess.run(
            [sys.executable, "-m", "infra.ops.cli", *RUN], cwd=PROJECT, env=env, capture_output=True, text=True
        )
        if run.returncode != 0:
            raise RuntimeError(run.stderr[-3000:])
        figures |= {"run_s": time.perf_counter() - began, "run_cpu": group_cpu_seconds(pgid) - cpu}
        return figures
    finally:
        servers.stop(folder, timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    print(f"{args.requests} requests, then `alignflow {' '.join(RUN)}`; {args.rounds} rounds, arms interleaved")
    print(f"load average before: {os.getloadavg()[0]:.2f}\n")
    print("| round | arm | requests: wall s | server CPU s | run: wall s | server CPU s |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(1, args.rounds + 1):
            for arm, cache_seconds in ARMS.items():
                f = measure(cache_seconds, args.requests, Path(scratch) / f"{round_}-{cache_seconds}")
                print(
                    f"| {round_} | {arm} | {f['requests_s']:.2f} | {f['requests_cpu']:.2f} "
                    f"| {f['run_s']:.1f} | {f['run_cpu']:.1f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
