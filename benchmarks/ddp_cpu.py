"""CPU DDP: DPO throughput of 2 gloo processes against 1 process on the same work, in one run.

Both runs train the same optimizer steps on the same global batches (1 process × B pairs vs.
2 processes × B/2 pairs), launched by ``accelerate launch`` through ``tasks.launch`` (a ``TrainJob``) with one
torch thread per process; the figure is the ratio of their ``train_runtime`` (the Trainer's
training loop, without process start-up and model loading), also shown with start-up included.

    .venv/bin/python benchmarks/ddp_cpu.py                     # built-in tiny model, 64 pairs per step
    .venv/bin/python benchmarks/ddp_cpu.py --pairs 32 --steps 8
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import datasets

from infra.core.config import ComputeConfig
from infra.core.handles import PreparedData
from infra.core.stage_io import TrainInputs
from tasks.launch import launch, untracked_train_job
from tasks.models import checkpoint_handle
from trainers.builtin_model import save_builtin_model
from trainers.data import Truncation, tokenize_split
from trainers.modeling import load_causal_lm
from trainers.reference import reference_logps
from trainers.synthetic import AdditionTask, generate_addition


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=64, help="pairs per optimizer step (global batch)")
    parser.add_argument("--steps", type=int, default=10)
    return parser.parse_args()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


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


def run(inputs: TrainInputs, processes: int, pairs: int, steps: int, folder: Path) -> tuple[float, float]:
    """(train_runtime, wall seconds with start-up) of one launch."""
    section = {"per_device_train_batch_size": pairs // processes, "max_steps": steps, "logging_steps": steps}
    compute = ComputeConfig(cpu=True, num_processes=processes, main_process_port=free_port())
    job = untracked_train_job("dpo", section | {"eval_strategy": "no"}, replace(inputs, compute=compute), folder)
    os.environ["OMP_NUM_THREADS"] = "1"  # in each process
    started = time.perf_counter()
    history = launch(job, "dpo", lambda line: None)
    wall = time.perf_counter() - started
    (summary,) = [entry for entry in history.log_history if "train_runtime" in entry]
    return summary["train_runtime"], wall


def main() -> None:
    options = parse_args()
    folder = Path(tempfile.mkdtemp(prefix="alignflow-ddp-bench-"))
    inputs = prepare(folder, options.pairs * options.steps)
    load = os.getloadavg()
    one = run(inputs, 1, options.pairs, options.steps, folder / "one")
    two = run(inputs, 2, options.pairs, options.steps, folder / "two")
    print(f"DPO, built-in tiny model, {options.pairs} pairs per step, {options.steps} steps, 1 thread per process")
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (on {os.cpu_count()} cores)")
    print("| processes | train_runtime (s) | wall with start-up (s) | pairs/s (train) |")
    print("|---|---|---|---|")
    for processes, (runtime, wall) in ((1, one), (2, two)):
        print(f"| {processes} | {runtime:.2f} | {wall:.1f} | {options.pairs * options.steps / runtime:.1f} |")
    print(f"throughput ratio, 2 processes / 1: {one[0] / two[0]:.2f} (train loop), {one[1] / two[1]:.2f} (wall)")


if __name__ == "__main__":
    main()
