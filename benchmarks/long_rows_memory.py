"""Peak memory of a DPO step at long rows and a 151,936-entry vocabulary: 512 against 2,048 tokens,
the LM head applied in chunks (the default past 256 MiB of logits) against materialised logits.

A small Llama (hidden 256, 2 layers, Qwen2.5's vocabulary size, tied embeddings, float32, random
weights) trains with ``DPOTrainer`` (cached reference, sigmoid loss) on one pair per step whose rows
are ``--lengths`` tokens (a quarter prompt, the rest completion: the scored positions, whose logits
are the memory peak). Each (length, head) runs in a fresh process; its figure is the peak RSS
(``VmHWM``) minus the RSS before training (model, optimizer state excluded: Adam's state appears at
the first step and is the same at every length), so what a step adds.

    .venv/bin/python benchmarks/long_rows_memory.py                  # a markdown table
    .venv/bin/python benchmarks/long_rows_memory.py --lengths 256 512 --json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainers.models.builtin import TINY_LLAMA  # noqa: E402

# The built-in tiny Llama's layout, wider, with Qwen2.5's vocabulary: 41M parameters, 39M of them the embedding.
MODEL = TINY_LLAMA | dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, vocab_size=151_936)


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise KeyError(field)


def child(length: int, chunked: bool, steps: int) -> dict:
    import datasets
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainers.data.collators import PreferenceCollator
    from trainers.dpo.trainer import DPOConfig, DPOTrainer
    from trainers.scoring import logprobs

    torch.set_num_threads(1)
    if not chunked:
        logprobs.HEAD_IN_CHUNKS_ELEMENTS = 1 << 62
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**(MODEL | {"max_position_embeddings": length}), pad_token_id=0))
    rng = random.Random(0)

    def tokens(count: int) -> list[int]:
        return [rng.randrange(1, MODEL["vocab_size"]) for _ in range(count)]

    prompt = length // 4
    rows = [
        {
            "prompt_ids": tokens(prompt),
            "chosen_ids": tokens(length - prompt),
            "rejected_ids": tokens(length - prompt),
            "ref_chosen_logps": 0.0,
            "ref_rejected_logps": 0.0,
        }
        for _ in range(steps)
    ]
    with tempfile.TemporaryDirectory() as output_dir:
        args = DPOConfig(
            output_dir=output_dir,
            max_steps=steps,
            per_device_train_batch_size=1,
            reference="cached",
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
            dataloader_pin_memory=False,
            train_sampling_strategy="sequential",
        )
        trainer = DPOTrainer(
            model=model,
            args=args,
            train_dataset=datasets.Dataset.from_list(rows),
            data_collator=PreferenceCollator(0),
        )
        before = status_kib("VmRSS")
        trainer.train()
    return {
        "length": length,
        "head": "in chunks" if chunked else "materialised",
        "step_peak_mib": (status_kib("VmHWM") - before) / 1024,
        "logits_mib": 2 * (length - prompt) * MODEL["vocab_size"] * 4 / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        length, chunked = options.child.split(":")
        print(json.dumps(child(int(length), chunked == "1", options.steps)))
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}  # freed tensor buffers leave the RSS
    results = []
    for chunked in (True, False):
        for length in options.lengths:
            command = [sys.executable, __file__, f"--child={length}:{int(chunked)}", f"--steps={options.steps}"]
            done = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    if options.json:
        print(json.dumps(results, indent=1))
        return
    print("| head | row tokens | scored logits (MiB, float32) | a step's peak over the RSS before it (MiB) |")
    print("|---|---:|---:|---:|")
    for r in results:
        print(f"| {r['head']} | {r['length']} | {r['logits_mib']:.0f} | {r['step_peak_mib']:.0f} |")


if __name__ == "__main__":
    main()
