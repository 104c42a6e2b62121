"""DPO step throughput and peak memory: cached reference log-probs vs. a live reference model.

A ~36M-parameter Llama built from config (random weights, no downloads) trains with
``DPOTrainer`` on random token pairs. Each mode runs in a fresh process so that its peak RSS
(``VmHWM`` of ``/proc/self/status``: the peak of this process image, not inherited from the
parent as ``ru_maxrss`` would be) is its own; the cached mode reads reference log-probs computed beforehand, in
another process, with the same function the pipeline uses (``trainers.scoring.reference_pass.reference_logps``).

    .venv/bin/python benchmarks/dpo.py                 # prints a markdown table
    .venv/bin/python benchmarks/dpo.py --steps 8 --batch-size 8 --threads 4
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import datasets
import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainers.data.collators import PreferenceCollator  # noqa: E402
from trainers.dpo.trainer import DPOConfig, DPOTrainer  # noqa: E402
from trainers.scoring.reference_pass import reference_logps  # noqa: E402

MODEL = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=8,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)
PAD, EOS = 0, 2


def build_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(pad_token_id=PAD, eos_token_id=EOS, bos_token_id=1, **MODEL))


def random_pairs(count: int, prompt_length: int, completion_length: int, seed: int = 0) -> list[dict]:
    """Prompts of ``prompt_length/2 .. prompt_length`` tokens, completions of ``completion_length/2
    .. completion_length`` tokens ending with EOS."""
    rng = random.Random(seed)

    def tokens(low: int, high: int) -> list[int]:
        return [rng.randrange(3, MODEL["vocab_size"]) for _ in range(rng.randint(low, high))]

    half_prompt, half_completion = prompt_length // 2, completion_length // 2
    return [
        {
            "prompt_ids": tokens(half_prompt, prompt_length),
            "chosen_ids": tokens(half_completion - 1, completion_length - 1) + [EOS],
            "rejected_ids": tokens(half_completion - 1, completion_length - 1) + [EOS],
        }
        for _ in range(count)
    ]


class StepTimer(TrainerCallback):
    """Wall and process CPU seconds of each optimizer step (CPU time is the steadier figure on a
    shared machine: other jobs stretch wall time, not the work this process does)."""

    def __init__(self):
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.started = (time.perf_counter(), time.process_time())

    def on_step_end(self, args, state, control, **kwargs):
        self.wall.append(time.perf_counter() - self.started[0])
        self.cpu.append(time.process_time() - self.started[1])


def tokens_per_step(rows: list[dict], batch_size: int, steps: int) -> list[int]:
    """Non-padding tokens (prompt twice, chosen and rejected) of each sequential batch."""
    sizes = [2 * len(r["prompt_ids"]) + len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in rows]
    return [sum(sizes[s * batch_size : (s + 1) * batch_size]) for s in range(steps)]


def peak_rss_kib() -> int:
    return int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def run_mode(mode: str, options: argparse.Namespace, ref_file: Path) -> dict:
    torch.set_num_threads(options.threads)
    steps = options.warmup + options.steps
    rows = random_pairs(steps * options.batch_size, options.prompt_length, options.completion_length)
    policy = build_model()
    ref_model = None
    if mode == "live":
        ref_model = copy.deepcopy(policy)
    else:
        cached = json.loads(ref_file.read_text())
        rows = [
            dict(r, ref_chosen_logps=c, ref_rejected_logps=j)
            for r, c, j in zip(rows, cached["chosen"], cached["rejected"])
        ]
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as output_dir:
        args = DPOConfig(
            output_dir=output_dir,
            max_steps=steps,
            per_device_train_batch_size=options.batch_size,
            learning_rate=1e-5,
            train_sampling_strategy="sequential",
            logging_steps=steps,
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
            dataloader_pin_memory=False,
            beta=0.1,
            reference="live" if mode == "live" else "cached",
        )
        trainer = DPOTrainer(
            model=policy,
            ref_model=ref_model,
            args=args,
            train_dataset=datasets.Dataset.from_list(rows),
            data_collator=PreferenceCollator(PAD),
            callbacks=[timer],
        )
        trainer.train()
    wall, cpu = timer.wall[options.warmup :], timer.cpu[options.warmup :]
    tokens = sum(tokens_per_step(rows, options.batch_size, steps)[options.warmup :])
    return {
        "mode": mode,
        "step_seconds": sum(wall) / len(wall),
        "step_cpu_seconds": sum(cpu) / len(cpu),
        "tokens_per_second": tokens / sum(wall),
        "peak_rss_mib": peak_rss_kib() / 1024,
    }


def prepare_reference(options: argparse.Namespace, ref_file: Path) -> None:
    torch.set_num_threads(options.threads)
    rows = random_pairs(
        (options.warmup + options.steps) * options.batch_size, options.prompt_length, options.completion_length
    )
    chosen, rejected = reference_logps(build_model(), PAD, rows, batch_size=options.batch_size, progress=False)
    ref_file.write_text(json.dumps({"chosen": chosen, "rejected": rejected}))


def run_worker(role: str, options: argparse.Namespace, ref_file: Path) -> str:
    flags = [
        f"--{name.replace('_', '-')}={value}"
        for name, value in vars(options).items()
        if name not in ("worker", "ref_file")
    ]
    command = [sys.executable, __file__, f"--worker={role}", f"--ref-file={ref_file}", *flags]
    # Pin glibc's mmap threshold so freed tensor buffers leave the RSS; by default the threshold
    # grows after frees and freed heap stays resident, which blurs peak-RSS comparisons.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    return subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="timed optimizer steps per mode")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--batch-size", type=int, default=4, help="pairs per step (2x rows per forward)")
    parser.add_argument("--prompt-length", type=int, default=64, help="max prompt tokens (min is half)")
    parser.add_argument("--completion-length", type=int, default=32, help="max completion tokens (min is half)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 avoids oversubscribing a shared CPU)")
    parser.add_argument("--worker", choices=["prepare", "cached", "live"], help=argparse.SUPPRESS)
    parser.add_argument("--ref-file", type=Path, help=argparse.SUPPRESS)
    options = parser.parse_args()

    if options.worker == "prepare":
        return prepare_reference(options, options.ref_file)
    if options.worker:
        print(json.dumps(run_mode(options.worker, options, options.ref_file)))
        return

    with tempfile.TemporaryDirectory() as scratch:
        ref_file = Path(scratch) / "ref_logps.json"
        run_worker("prepare", options, ref_file)
        results = {}
        for mode in ("live", "cached"):
            results[mode] = json.loads(run_worker(mode, options, ref_file).strip().splitlines()[-1])
    parameters = sum(p.numel() for p in build_model().parameters())
    live, cached = results["live"], results["cached"]
    print(
        f"model: Llama {parameters / 1e6:.1f}M parameters ({parameters * 4 / 2**20:.0f} MiB float32); "
        f"{options.batch_size} pairs/step, prompts ≤ {options.prompt_length}, "
        f"completions ≤ {options.completion_length} tokens, "
        f"{options.steps} timed steps after {options.warmup} warm-up, {options.threads} threads"
    )
    print(
        "| reference | step wall time (s) | step CPU time (s) | "
        "tokens/s (wall) | peak RSS (MiB) |\n|---|---|---|---|---|"
    )
    for r in (live, cached):
        print(
            f"| {r['mode']} | {r['step_seconds']:.3f} | {r['step_cpu_seconds']:.3f} "
            f"| {r['tokens_per_second']:.0f} | {r['peak_rss_mib']:.0f} |"
        )
    print(
        f"cached/live step time: wall {cached['step_seconds'] / live['step_seconds']:.2f}, "
        f"CPU {cached['step_cpu_seconds'] / live['step_cpu_seconds']:.2f}; "
        f"peak RSS saved: {live['peak_rss_mib'] - cached['peak_rss_mib']:.1f} "
        f"MiB (reference weights: {parameters * 4 / 2**20:.1f} MiB)"
    )


if __name__ == "__main__":
    main()
