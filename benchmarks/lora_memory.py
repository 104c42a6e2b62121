"""Peak memory of DPO with a live reference: full fine-tuning vs. LoRA.

The model is ``benchmarks/dpo.py``'s ~36M-parameter Llama (random weights, no downloads; or
``--model builtin:llama-0.5b``, the 494M Qwen2.5-0.5B shape), saved
as a checkpoint folder; each mode builds its trainer through the pipeline's DPO stage builder
(``STAGES["dpo"].build`` with ``dpo.reference: live``), in a fresh process, and trains a few
steps on random token pairs:

* **full**: every weight trains; the reference is a second frozen model loaded from the folder;
  AdamW keeps two moments per weight.
* **lora**: adapters (``peft``, all linear layers but the head) train on the frozen policy; the
  reference is the policy with its adapters disabled, no second model.

Figures per process: peak RSS (``VmHWM``), RSS after imports (before any model is loaded), their
difference (what training took), and on CUDA ``torch.cuda.max_memory_allocated``.

    .venv/bin/python benchmarks/lora_memory.py            # prints a markdown table
    .venv/bin/python benchmarks/lora_memory.py --steps 3 --batch-size 8 --rank 16
    .venv/bin/python benchmarks/lora_memory.py --model builtin:llama-0.5b --modes lora \
        --gradient-checkpointing True --batch-size 2 --prompt-length 16 --completion-length 8
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpo import EOS, MODEL, PAD, peak_rss_kib, random_pairs  # noqa: E402  (benchmarks/dpo.py)

MODES = ("full", "lora")
# `dpo`: benchmarks/dpo.py's 35.7M Llama; `small`: an 11.6M one (the same vocabulary) for a quick check
ARCHITECTURES = {
    "dpo": MODEL,
    "small": dict(
        MODEL, hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4
    ),
}


def rss_kib() -> int:
    return int(re.search(r"VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def save_checkpoint(model_name: str, folder: Path) -> int:
    """One of ``ARCHITECTURES`` (with the built-in tokenizer: ids 0-2 are pad, bos, eos, as the
    model's) or a ``builtin:`` model with a vocabulary of at least 32,000 rows (the random
    pairs' token ids), saved as a checkpoint folder; returns its parameter count."""
    from trainers.models.builtin import build_builtin_model, build_char_tokenizer

    if model_name in ARCHITECTURES:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(pad_token_id=PAD, eos_token_id=EOS, bos_token_id=1, **ARCHITECTURES[model_name])
        model, tokenizer = LlamaForCausalLM(config), build_char_tokenizer()
    else:
        model, tokenizer = build_builtin_model(model_name, seed=0)
        if model.config.vocab_size < 32000:
            raise SystemExit(f"{model_name}: vocabulary {model.config.vocab_size} < 32,000 (the pairs' token ids)")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def run_mode(mode: str, options: argparse.Namespace) -> dict:
    import datasets
    import torch

    from infra.core.config import ComputeConfig
    from trainers.catalog import STAGES, ModelSource, StageInputs
    from trainers.dpo.section import DPOStageConfig
    from trainers.models.lora import LoraSettings, trainable_parameters

    torch.set_num_threads(options.threads)
    rows = random_pairs(options.steps * options.batch_size, options.prompt_length, options.completion_length)
    section = DPOStageConfig(
        reference="live",
        max_steps=options.steps,
        per_device_train_batch_size=options.batch_size,
        learning_rate=1e-5,
        logging_steps=options.steps,
        gradient_checkpointing=options.gradient_checkpointing,
    )
    before = rss_kib()
    source = ModelSource(str(options.checkpoint))
    compute = ComputeConfig()
    with tempfile.TemporaryDirectory() as output_dir:
        inputs = StageInputs(
            policy=source,
            reference=source,
            splits={"preference": datasets.Dataset.from_list(rows)},
            output_dir=output_dir,
            dtype=compute.dtype,
            mixed_precision=compute.mixed_precision,
            cpu=compute.cpu,
            padding_free=compute.padding_free,
            lora=LoraSettings(r=options.rank, alpha=2.0 * options.rank) if mode == "lora" else None,
        )
        trainer = STAGES["dpo"].build(section, inputs)
        trainable = trainable_parameters(trainer.model)
        second_model = trainer.ref_model is not None
        trainer.train()
    assert trainer.state.global_step == options.steps and PAD == 0
    return {
        "mode": mode,
        "trainable": trainable,
        "second_model": second_model,
        "rss_before_mib": before / 1024,
        "step_seconds": trainer.state.log_history[-1]["train_runtime"] / options.steps,
        "peak_rss_mib": peak_rss_kib() / 1024,
        "cuda_peak_mib": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None,
    }


def run_worker(mode: str, options: argparse.Namespace) -> dict:
    flags = [
        f"--{name.replace('_', '-')}={value}" for name, value in vars(options).items() if name not in ("worker", "json")
    ]
    # Pin glibc's mmap threshold so freed tensor buffers leave the RSS (as benchmarks/dpo.py does).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    output = subprocess.run(
        [sys.executable, __file__, f"--worker={mode}", *flags], check=True, capture_output=True, text=True, env=env
    ).stdout
    return json.loads(output.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per mode")
    parser.add_argument("--batch-size", type=int, default=4, help="pairs per step (2x rows per forward)")
    parser.add_argument("--prompt-length", type=int, default=64, help="max prompt tokens (min is half)")
    parser.add_argument("--completion-length", type=int, default=32, help="max completion tokens (min is half)")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank r (alpha = 2r)")
    parser.add_argument("--gradient-checkpointing", type=lambda v: v == "True", default=False, help="True/False")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 avoids oversubscribing a shared CPU)")
    parser.add_argument("--model", default="dpo", help="`dpo` (36M Llama), `small` (12M) or `builtin:llama-0.5b`")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON line, not a table")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated: full, lora")
    parser.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        print(json.dumps(run_mode(options.worker, options)))
        return

    with tempfile.TemporaryDirectory() as scratch:
        options.checkpoint = Path(scratch) / "model"
        parameters = save_checkpoint(options.model, options.checkpoint)
        results = [run_worker(mode, options) for mode in options.modes.split(",")]
    if options.json:
        print(json.dumps({"parameters": parameters, "results": results}))
        return
    weights_mib = parameters * 4 / 2**20
    print(
        f"model: {options.model} Llama {parameters / 1e6:.1f}M parameters ({weights_mib:.0f} MiB float32); "
        "DPO, reference: live, "
        f"{options.batch_size} pairs/step, prompts ≤ {options.prompt_length}, completions ≤ "
        f"{options.completion_length} tokens, {options.steps} steps, LoRA r={options.rank} all-linear, "
        f"gradient checkpointing {options.gradient_checkpointing}, {options.threads} threads"
    )
    print(
        "| mode | trainable parameters | second model | RSS before (MiB) | peak RSS (MiB) | peak − before (MiB) "
        "| step (s) |\n|---|---|---|---|---|---|---|"
    )
    for r in results:
        print(
            f"| {r['mode']} | {r['trainable']:,} | {'yes' if r['second_model'] else 'no'} | {r['rss_before_mib']:.0f} "
            f"| {r['peak_rss_mib']:.0f} | {r['peak_rss_mib'] - r['rss_before_mib']:.0f} | {r['step_seconds']:.1f} |"
            + (f" CUDA peak {r['cuda_peak_mib']:.0f} MiB" if r["cuda_peak_mib"] is not None else "")
        )
    if len(results) != 2:
        return
    full, lora = results
    saved = full["peak_rss_mib"] - lora["peak_rss_mib"]
    print(
        f"LoRA saves {saved:.0f} MiB of peak RSS = {saved / weights_mib:.1f}× the weights "
        "(full fine-tuning adds a reference copy, gradients and two AdamW moments: ~4× the weights)"
    )


if __name__ == "__main__":
    main()
