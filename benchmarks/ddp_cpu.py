"""CPU DDP: DPO throughput of 2 gloo processes against 1 process on the same work, and of 2
"machines" of 1 process each (both on this host) against 1 machine of 2, in one run.

The runs train the same optimizer steps on the same global batches (1 process × B pairs vs.
2 processes × B/2 pairs), launched by ``accelerate launch`` through ``tasks.launch`` (a ``TrainJob``)
with one torch thread per process; for 2 machines, machine 1's part is ``python -m tasks.machine
SPEC --machine-rank 1``, started once machine 0 wrote the spec. The figure is the ratio of their
``train_runtime`` (the Trainer's training loop), also with start-up included, and where each
launch's time went: the machines' join, rank 0 starting (launcher, interpreter, imports), its
trainer being built (model, data, process group: the rendezvous), the training loop, the rest
(saving the model, the ranks' exit).

    .venv/bin/python benchmarks/ddp_cpu.py                     # built-in tiny model, 64 pairs per step
    .venv/bin/python benchmarks/ddp_cpu.py --pairs 32 --steps 8
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import datasets

from infra.core.config import ComputeConfig
from infra.core.handles import PreparedData
from infra.core.ports import free_port
from infra.core.stage_io import TrainInputs
from tasks.launch import launch, untracked_train_job
from tasks.machine import machine_runner
from tasks.models import checkpoint_handle
from trainers.data.rows import Truncation, tokenize_split
from trainers.data.synthetic import AdditionTask, generate_addition
from trainers.models.builtin import save_builtin_model
from trainers.models.pretrained import load_causal_lm
from trainers.scoring.reference_pass import reference_logps

REPO = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=64, help="pairs per optimizer step (global batch)")
    parser.add_argument("--steps", type=int, default=10)
    return parser.parse_args()


def prepare(folder: Path, pairs_needed: int) -> dict:
    model_dir = save_builtin_model("builtin:tiny-llama", 0, folder / "model")
    model, tokenizer = load_causal_lm(str(model_dir))
    rows = generate_addition(AdditionTask(max_operand=49, num_eval_problems=20))["preference"][:pairs_needed]
    pairs, _ = tokenize_split(rows, "preference", tokenizer, Truncation(32, 16))
    chosen, rejected = reference_logps(model, tokenizer.pad_token_id, pairs, batch_size=64, progress=False)
    pairs = [dict(r, ref_chosen_logps=c, ref_rejected_logps=j) for r, c, j in zip(pairs, chosen, rejected)]
    datasets.DatasetDict({"preference": datasets.Dataset.from_list(pairs)}).save_to_disk(folder / "splits")
    data = PreparedData(
        path=str(folder / "splits"), fingerprint="-", rows={}, dropped={}, token_fingerprints={}, truncation={}
    )
    return TrainInputs(checkpoint_handle(model_dir, "init"), data)


@dataclass(frozen=True)
class Timing:
    runtime: float  # the Trainer's training loop
    wall: float  # the whole launch
    join: float  # until every machine had joined
    start: float  # from the launch to rank 0 running
    build: float  # from there to its trainer built

    @property
    def rest(self) -> float:
        return self.wall - self.join - self.start - self.build - self.runtime


STARTED = re.compile(r"rank 0: running ([0-9.]+) s after the launch started .*; trainer built .* ([0-9.]+) s later")


def run(inputs: TrainInputs, compute: ComputeConfig, pairs: int, steps: int, folder: Path) -> Timing:
    """One launch of DPO over ``compute``'s processes (and machines: machine 1 started here)."""
    section = {
        "per_device_train_batch_size": pairs // compute.num_processes,
        "max_steps": steps,
        "logging_steps": steps,
    }
    job = untracked_train_job("dpo", section | {"eval_strategy": "no"}, replace(inputs, compute=compute), folder)
    os.environ["OMP_NUM_THREADS"] = "1"  # in each process
    stamped: list[tuple[float, str]] = []
    machine_one = None
    if compute.num_machines > 1:
        machine_one = threading.Thread(target=run_machine_one, args=(job.spec_file,), daemon=True)
        machine_one.start()
    started = time.perf_counter()
    history = launch(job, "dpo", lambda line: stamped.append((time.perf_counter(), line)))
    wall = time.perf_counter() - started
    if machine_one is not None:
        machine_one.join()
    (summary,) = [entry for entry in history.log_history if "train_runtime" in entry]
    launched = next(at for at, line in stamped if line.startswith(f"dpo on {compute.num_processes} processes"))
    (match,) = [m for _, line in stamped if (m := STARTED.search(line))]
    start, build = float(match.group(1)), float(match.group(2))
    return Timing(summary["train_runtime"], wall, launched - started, start, build)


def run_machine_one(spec_file: Path) -> None:
    while not spec_file.exists():
        time.sleep(0.05)
    subprocess.run(machine_runner(spec_file, 1), cwd=REPO, check=True, capture_output=True)


def main() -> None:
    options = parse_args()
    folder = Path(tempfile.mkdtemp(prefix="alignflow-ddp-bench-"))
    inputs = prepare(folder, options.pairs * options.steps)
    load = os.getloadavg()
    layouts = {
        "1 machine × 1 process": ComputeConfig(cpu=True, main_process_port=free_port()),
        "1 machine × 2 processes": ComputeConfig(cpu=True, num_processes=2, main_process_port=free_port()),
        "2 machines × 1 process": ComputeConfig(
            cpu=True, num_processes=2, num_machines=2, main_process_ip="127.0.0.1", main_process_port=free_port()
        ),
    }
    timings = {
        name: run(inputs, compute, options.pairs, options.steps, folder / f"run{index}")
        for index, (name, compute) in enumerate(layouts.items())
    }
    print(f"DPO, built-in tiny model, {options.pairs} pairs per step, {options.steps} steps, 1 thread per process")
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (on {os.cpu_count()} cores)")
    print(
        "| layout | train loop (s) | wall (s) | join (s) | rank 0 start (s) | trainer built (s) | rest (s) "
        "| pairs/s (train) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, t in timings.items():
        cells = [t.runtime, t.wall, t.join, t.start, t.build, t.rest]
        pairs_per_s = options.pairs * options.steps / t.runtime
        print(f"| {name} | " + " | ".join(f"{value:.2f}" for value in cells) + f" | {pairs_per_s:.1f} |")
    one, two, machines = timings.values()
    print(
        f"throughput ratio, 2 processes / 1: {one.runtime / two.runtime:.2f} (train loop), "
        f"{one.wall / two.wall:.2f} (wall)"
    )
    print(
        f"2 machines × 1 / 1 machine × 2: {machines.runtime / two.runtime:.2f} × the train loop, "
        f"{machines.wall / two.wall:.2f} × the wall time"
    )


if __name__ == "__main__":
    main()
