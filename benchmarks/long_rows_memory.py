"""Peak memory of a DPO step at long rows and a 151,936-entry vocabulary: 512 against 2,048 tokens,
the LM head applied in chunks (the default past 256 MiB of logits) against materialised logits, and
TRL 1.16's ``DPOTrainer`` at the same shape (its LM head always in chunks).

A small Llama (hidden 256, 2 layers, Qwen2.5's vocabulary size, tied embeddings, float32, random
weights) trains with ``DPOTrainer`` (cached reference, sigmoid loss) on one pair per step whose rows
are ``--lengths`` tokens (a quarter prompt, the rest completion: the scored positions, whose logits
are the memory peak). Each (length, head) runs in a fresh process; its figure is the peak RSS
(``VmHWM``, reset just before training, so TRL's reference pass at set-up is not counted) minus the
RSS then (model, optimizer state excluded: Adam's state appears at the first step and is the same at
every length), so what a step adds. TRL tokenizes text: its rows are the built-in character
tokenizer's, one token a character, the same lengths; it runs from ``--trl`` (installed beside the
venv, as for ``chat_shapes.py``), and is left out when that folder is missing.

    .venv/bin/pip install --no-deps --target .bench/trl trl==1.16.0
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

PROJECT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT))

from trainers.models.builtin import TINY_LLAMA  # noqa: E402

# The built-in tiny Llama's layout, wider, with Qwen2.5's vocabulary: 41M parameters, 39M of them the embedding.
MODEL = TINY_LLAMA | dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, vocab_size=151_936)


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise KeyError(field)


HEADS = {"chunks": "alignflow, in chunks", "materialised": "alignflow, materialised", "trl": "TRL 1.16"}


def common_arguments(output_dir: str, steps: int) -> dict:
    return dict(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        dataloader_pin_memory=False,
        train_sampling_strategy="sequential",
    )


def alignflow_trainer(model, rows: list[dict], chunked: bool, output_dir: str, steps: int):
    import datasets

    from trainers.data.collators import PreferenceCollator
    from trainers.dpo.trainer import DPOConfig, DPOTrainer
    from trainers.scoring import logprobs

    if not chunked:
        logprobs.HEAD_IN_CHUNKS_ELEMENTS = 1 << 62
    cached = [row | {"ref_chosen_logps": 0.0, "ref_rejected_logps": 0.0} for row in rows]
    args = DPOConfig(**common_arguments(output_dir, steps), reference="cached")
    return DPOTrainer(
        model=model, args=args, train_dataset=datasets.Dataset.from_list(cached), data_collator=PreferenceCollator(0)
    )


def trl_trainer(model, rows: list[dict], output_dir: str, steps: int):
    import datasets
    import trl

    from trainers.models.builtin import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    alphabet = [tokenizer.convert_ids_to_tokens(i) for i in range(len(tokenizer)) if i not in tokenizer.all_special_ids]
    text = [
        {
            name: "".join(alphabet[i % len(alphabet)] for i in row[f"{name}_ids"])
            for name in ("prompt", "chosen", "rejected")
        }
        for row in rows
    ]
    length = len(rows[0]["prompt_ids"]) + len(rows[0]["chosen_ids"])
    args = trl.DPOConfig(
        **common_arguments(output_dir, steps),
        max_length=length + 1,  # the EOS TRL appends
        beta=0.1,
        precompute_ref_log_probs=True,
        bf16=False,
        gradient_checkpointing=False,  # as alignflow's step runs; TRL's default turns it on
    )
    return trl.DPOTrainer(
        model=model, args=args, train_dataset=datasets.Dataset.from_list(text), processing_class=tokenizer
    )


def child(length: int, head: str, steps: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**(MODEL | {"max_position_embeddings": length + 1}), pad_token_id=0))
    rng = random.Random(0)

    def tokens(count: int) -> list[int]:
        return [rng.randrange(1, MODEL["vocab_size"]) for _ in range(count)]

    prompt = length // 4
    rows = [
        {"prompt_ids": tokens(prompt), "chosen_ids": tokens(length - prompt), "rejected_ids": tokens(length - prompt)}
        for _ in range(steps)
    ]
    with tempfile.TemporaryDirectory() as output_dir:
        if head == "trl":
            trainer = trl_trainer(model, rows, output_dir, steps)
        else:
            trainer = alignflow_trainer(model, rows, head == "chunks", output_dir, steps)
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here on
        before = status_kib("VmRSS")
        trainer.train()
    return {
        "length": length,
        "head": HEADS[head],
        "step_peak_mib": (status_kib("VmHWM") - before) / 1024,
        "logits_mib": 2 * (length - prompt) * MODEL["vocab_size"] * 4 / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--trl", type=Path, default=PROJECT / ".bench" / "trl", help="where TRL is installed")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        length, head = options.child.split(":")
        print(json.dumps(child(int(length), head, options.steps)))
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}  # freed tensor buffers leave the RSS
    heads = ["chunks", "materialised"] + (["trl"] if options.trl.is_dir() else [])
    results = []
    for head in heads:
        for length in options.lengths:
            command = [sys.executable, __file__, f"--child={length}:{head}", f"--steps={options.steps}"]
            child_env = env
            if head == "trl":
                child_env = env | {
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(options.trl), env.get("PYTHONPATH")]))
                }
            done = subprocess.run(command, capture_output=True, text=True, env=child_env)
            if done.returncode != 0:
                raise SystemExit(f"{head} at {length} tokens failed:\n{done.stderr[-4000:]}")
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    if options.json:
        print(json.dumps(results, indent=1))
        return
    print("| step | row tokens | scored logits (MiB, float32) | a step's peak over the RSS before it (MiB) |")
    print("|---|---:|---:|---:|")
    for r in results:
        print(f"| {r['head']} | {r['length']} | {r['logits_mib']:.0f} | {r['step_peak_mib']:.0f} |")


if __name__ == "__main__":
    main()
