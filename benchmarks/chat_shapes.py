"""Real-token throughput, step time and peak memory at chat shapes: alignflow padded, alignflow
padding-free, and TRL 1.16 in its fastest configuration, on the same rows, one process each.

The rows are chat-shaped (``trainers.data.chat_shapes``: long-tailed lengths up to ``--max-length``),
tokenized by the built-in character tokenizer (one token per character); the model is a Llama built
from a built-in shape (random weights, float32). Each (stage, framework) runs in a fresh process
(its peak RSS its own, ``VmHWM``), the frameworks interleaved round by round, every process on
``--threads`` threads. Rows are read in order (``train_sampling_strategy: sequential``), so every
framework trains on the same batches; real tokens are the batches' tokens without padding.

* ``sft``: alignflow's ``SFTTrainer`` (padded and padding-free) against TRL's ``SFTTrainer``
  (padded, and ``padding_free=True``: every row of a batch in one sequence).
* ``dpo-cached`` / ``dpo-live``: alignflow's ``DPOTrainer`` against TRL's (``precompute_ref_log_probs``
  for cached; TRL 1.16's ``padding_free`` for DPO is disabled, so TRL pads).
* ``grpo``: the part of a GRPO step padding-free changes (the reference log-prob pass, the loss and its
  backward over sampled completions of chat lengths; generation excluded), alignflow padded and packed
  (TRL has no padding-free GRPO; its GRPO step is not measured here).

TRL is a benchmark-only dependency, installed beside the project's environment, not into it:

    .venv/bin/pip install --no-deps --target .bench/trl trl==1.16.0
    .venv/bin/python benchmarks/chat_shapes.py --stages sft dpo-cached --rounds 2     # a markdown table
    .venv/bin/python benchmarks/chat_shapes.py --model tiny-llama --rows-per-step 4 --steps 1 --json   # a smoke
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import datasets
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpo import StepTimer, peak_rss_kib  # noqa: E402 (benchmarks/dpo.py)
from gpu_check import peak_flops  # noqa: E402 (benchmarks/gpu_check.py)

from trainers.data.chat_shapes import ChatShape, LengthDistribution, generate_chat_shaped  # noqa: E402
from trainers.data.rows import Truncation, tokenize_split  # noqa: E402

PROJECT = Path(__file__).resolve().parents[1]
FRAMEWORKS = {
    "sft": ("alignflow-padded", "alignflow", "trl", "trl-padding-free"),
    "dpo-cached": ("alignflow-padded", "alignflow", "trl"),
    "dpo-live": ("alignflow-padded", "alignflow", "trl"),
    "reference": ("alignflow-padded", "alignflow"),
    "grpo": ("alignflow-padded", "alignflow"),
}
# Model FLOPs per real token, in units of N (parameters): 6 a trained token (forward and backward), 2 a
# forward-only one; attention's sequence-quadratic term left out.
FLOPS_PER_TOKEN = {"sft": 6, "dpo-cached": 6, "dpo-live": 8, "reference": 2, "grpo": 8}


def shape_of(options: argparse.Namespace) -> ChatShape:
    default = ChatShape()
    most = options.max_length - 1  # the completion's EOS
    prompt = LengthDistribution(default.prompt.median, default.prompt.sigma, default.prompt.low, most // 2)
    completion = LengthDistribution(default.completion.median, default.completion.sigma, default.completion.low, most)
    return ChatShape(prompt, completion, most)


def build(options: argparse.Namespace):
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainers.models.builtin import BUILTIN_MODELS, build_char_tokenizer

    tokenizer = build_char_tokenizer()
    shape = dict(BUILTIN_MODELS[options.model]) | {"max_position_embeddings": options.max_length}
    shape.setdefault("vocab_size", len(tokenizer))
    torch.manual_seed(0)
    config = LlamaConfig(
        **shape,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config), tokenizer


def rows_of(options: argparse.Namespace, split: str, tokenizer) -> tuple[list[dict], list[dict]]:
    """The split's text rows and the same rows tokenized (every row fits ``--max-length``)."""
    count = (options.warmup + options.steps) * options.rows_per_step
    text = generate_chat_shaped(count, options.seed, shape_of(options))[split]
    tokenized, dropped = tokenize_split(text, split, tokenizer, Truncation(options.max_length, options.max_length // 2))
    assert dropped == 0 and len(tokenized) == count
    return text, tokenized


def real_tokens(row: dict) -> int:
    if "chosen_ids" in row:
        return 2 * len(row["prompt_ids"]) + len(row["chosen_ids"]) + len(row["rejected_ids"])
    return len(row["prompt_ids"]) + len(row["completion_ids"])


def quiet(output_dir: str, options: argparse.Namespace) -> dict:
    return dict(
        bf16=options.bf16,
        output_dir=output_dir,
        max_steps=options.warmup + options.steps,
        per_device_train_batch_size=options.rows_per_step,
        learning_rate=1e-5,
        train_sampling_strategy="sequential",
        logging_steps=10**6,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_pin_memory=False,
    )


def alignflow_trainer(stage: str, padded: bool, options, model, tokenizer, rows, output_dir):
    from trainers.data.collators import CompletionOnlyCollator, PreferenceCollator
    from trainers.dpo.trainer import DPOConfig, DPOTrainer
    from trainers.scoring.reference_pass import reference_logps
    from trainers.sft.trainer import SFTArguments, SFTTrainer

    padding_free = not padded
    if stage == "sft":
        args = SFTArguments(**quiet(output_dir, options), padding_free=padding_free)
        data = datasets.Dataset.from_list(rows)
        return SFTTrainer(
            model=model, args=args, train_dataset=data, data_collator=CompletionOnlyCollator(tokenizer.pad_token_id)
        )
    reference = copy.deepcopy(model)
    if stage == "dpo-cached":  # computed in this process before training, as TRL's precompute is
        chosen, rejected = reference_logps(
            reference, tokenizer.pad_token_id, rows, options.rows_per_step, False, padding_free=padding_free
        )
        rows = [r | {"ref_chosen_logps": c, "ref_rejected_logps": j} for r, c, j in zip(rows, chosen, rejected)]
        reference = None
    args = DPOConfig(
        **quiet(output_dir, options),
        beta=0.1,
        reference="live" if reference is not None else "cached",
        padding_free=padding_free,
    )
    return DPOTrainer(
        model=model,
        ref_model=reference,
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        data_collator=PreferenceCollator(tokenizer.pad_token_id),
    )


def trl_trainer(stage: str, padding_free: bool, options, model, tokenizer, text_rows, output_dir):
    import trl

    dataset = datasets.Dataset.from_list(text_rows)
    # TRL's fastest: its configs turn gradient checkpointing on by default (less memory, ~20% more compute)
    common = quiet(output_dir, options) | {"max_length": options.max_length, "gradient_checkpointing": False}
    if stage == "sft":
        if padding_free:  # TRL enforces no max_length then; every row fits it already
            common["max_length"] = None
        args = trl.SFTConfig(**common, padding_free=padding_free, completion_only_loss=True)
        return trl.SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    cached = stage == "dpo-cached"
    args = trl.DPOConfig(**common, beta=0.1, precompute_ref_log_probs=cached)
    reference = None if cached else copy.deepcopy(model)
    return trl.DPOTrainer(
        model=model, ref_model=reference, args=args, train_dataset=dataset, processing_class=tokenizer
    )


def grpo_steps(padded: bool, options, model, tokenizer, rows) -> list[float]:
    """Seconds of each step's reference pass, loss and backward over ``rows_per_step`` sampled
    completions (left-padded prompts, as GRPO lays them out); an optimizer step after each."""
    from trainers.grpo.trainer import GRPOConfig, GRPOTrainer

    def count(completions, **kwargs) -> list[float]:
        return [0.0] * len(completions)

    with tempfile.TemporaryDirectory() as output_dir:
        args = GRPOConfig(
            **quiet(output_dir, options),
            num_generations=options.rows_per_step,  # one group: the layout divides, whatever the rows
            max_completion_length=options.max_length - max(len(r["prompt_ids"]) for r in rows),
            beta=0.04,
            padding_free=not padded,
        )
        prompts = datasets.Dataset.from_list([{"prompt_ids": r["prompt_ids"]} for r in rows])
        trainer = GRPOTrainer(
            model=model, args=args, train_dataset=prompts, processing_class=tokenizer, reward_funcs=[count]
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    pad, seconds, device = tokenizer.pad_token_id, [], trainer.accelerator.device
    for step in range(options.warmup + options.steps):
        part_rows = rows[step * options.rows_per_step : (step + 1) * options.rows_per_step]
        left = max(len(r["prompt_ids"]) for r in part_rows)
        right = max(len(r["completion_ids"]) for r in part_rows)
        ids, mask, completion = [], [], []
        for r in part_rows:
            p, c = r["prompt_ids"], r["completion_ids"]
            ids.append([pad] * (left - len(p)) + p + c + [pad] * (right - len(c)))
            mask.append([0] * (left - len(p)) + [1] * (len(p) + len(c)) + [0] * (right - len(c)))
            completion.append([0] * left + [1] * len(c) + [0] * (right - len(c)))
        part = {
            "input_ids": torch.tensor(ids),
            "attention_mask": torch.tensor(mask),
            "completion_mask": torch.tensor(completion),
        }
        synchronize(device)
        started = time.perf_counter()
        with torch.autocast(device.type, torch.bfloat16, enabled=options.bf16):
            slices = [part]
            trainer.add_token_logps(trainer.ref_model, slices, "ref_logps")
            batch = slices[0] | {
                "advantages": torch.linspace(-1, 1, len(part_rows)),
                "tokens_per_step": torch.tensor(int(part["completion_mask"].sum())),
            }
            model.train()
            loss = trainer.compute_loss(model, {name: value.to(device) for name, value in batch.items()})
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        synchronize(device)
        seconds.append(time.perf_counter() - started)
    return seconds


def reference_steps(padded: bool, options, model, tokenizer, rows) -> list[float]:
    """Seconds of the reference pass (forward only, in bf16 with ``--bf16``) over each step's pairs."""
    from trainers.scoring.reference_pass import reference_logps

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = model.to(device, torch.bfloat16 if options.bf16 else torch.float32)
    seconds = []
    for step in range(options.warmup + options.steps):
        part = rows[step * options.rows_per_step : (step + 1) * options.rows_per_step]
        synchronize(device)
        started = time.perf_counter()
        reference_logps(model, tokenizer.pad_token_id, part, options.rows_per_step, False, padding_free=not padded)
        synchronize(device)
        seconds.append(time.perf_counter() - started)
    return seconds


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def peak_memory_mib() -> float:
    """The GPU's peak allocated memory where training ran on one, else the process's peak RSS."""
    return torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else peak_rss_kib() / 1024


def run_child(stage: str, framework: str, options: argparse.Namespace) -> dict:
    torch.set_num_threads(options.threads)
    model, tokenizer = build(options)
    split = "sft" if stage in ("sft", "grpo") else "preference"
    text, rows = rows_of(options, split, tokenizer)
    per_step = [
        sum(real_tokens(r) for r in rows[s * options.rows_per_step : (s + 1) * options.rows_per_step])
        for s in range(options.warmup + options.steps)
    ]
    if stage == "grpo":
        wall = grpo_steps(framework == "alignflow-padded", options, model, tokenizer, rows)
    elif stage == "reference":
        wall = reference_steps(framework == "alignflow-padded", options, model, tokenizer, rows)
    else:
        timer = StepTimer()
        with tempfile.TemporaryDirectory() as output_dir:
            if framework.startswith("trl"):
                trainer = trl_trainer(
                    stage, framework == "trl-padding-free", options, model, tokenizer, text, output_dir
                )
            else:
                trainer = alignflow_trainer(
                    stage, framework == "alignflow-padded", options, model, tokenizer, rows, output_dir
                )
            trainer.add_callback(timer)
            trainer.train()
        wall = timer.wall
    timed = wall[options.warmup :]
    speed = sum(per_step[options.warmup :]) / sum(timed)
    peak = peak_flops(options, torch.cuda.is_available())
    parameters = sum(p.numel() for p in model.parameters())
    return {
        "stage": stage,
        "framework": framework,
        "step_seconds": statistics.mean(timed),
        "real_tokens_per_second": speed,
        "mfu": None if peak is None else speed * FLOPS_PER_TOKEN[stage] * parameters / peak,
        "peak_memory_mib": peak_memory_mib(),
        "parameters": parameters,
        "real_tokens_per_step": statistics.mean(per_step[options.warmup :]),
    }


def child_process(stage: str, framework: str, options: argparse.Namespace) -> dict:
    flags = [
        f"--{name.replace('_', '-')}={value}".removesuffix("=True")
        for name, value in vars(options).items()
        if name in FORWARDED and value not in (None, False)
    ]
    command = [sys.executable, __file__, f"--child={stage}:{framework}", *flags]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}  # freed tensor buffers leave the RSS
    if framework.startswith("trl"):
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(options.trl.resolve()), env.get("PYTHONPATH")]))
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=PROJECT)
    if done.returncode != 0:
        raise SystemExit(f"{stage}/{framework} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


FORWARDED = ("model", "max_length", "rows_per_step", "steps", "warmup", "threads", "seed", "bf16", "peak_tflops")


def table(results: list[dict], options: argparse.Namespace) -> str:
    memory = "GPU memory" if options.device_kind == "cuda" else "RSS"
    lines = [
        f"model `builtin:{options.model}` shape ({results[0]['parameters'] / 1e6:.1f}M parameters, "
        f"{'bf16 autocast' if options.bf16 else 'float32'}), "
        f"{options.rows_per_step} rows per step (DPO: pairs), rows ≤ {options.max_length} tokens, "
        f"{options.steps} timed steps after {options.warmup}, {options.threads} thread(s), "
        f"median of {options.rounds} round(s)",
        "",
        f"| stage | framework | real tokens/step | step (s) | real tokens/s | vs TRL | MFU | peak {memory} (MiB) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    by_key: dict[tuple[str, str], list[dict]] = {}
    for result in results:
        by_key.setdefault((result["stage"], result["framework"]), []).append(result)

    def median(stage: str, framework: str, field: str) -> float:
        return statistics.median(r[field] for r in by_key[(stage, framework)])

    for stage, framework in by_key:
        speed = median(stage, framework, "real_tokens_per_second")
        trl = median(stage, "trl", "real_tokens_per_second") if (stage, "trl") in by_key else None
        mfu = None if by_key[(stage, framework)][0]["mfu"] is None else median(stage, framework, "mfu")
        lines.append(
            f"| {stage} | {framework} | {median(stage, framework, 'real_tokens_per_step'):.0f} | "
            f"{median(stage, framework, 'step_seconds'):.2f} | {speed:.0f} | "
            f"{'' if trl is None else f'{speed / trl:.2f}×'} | {'n/a' if mfu is None else f'{100 * mfu:.1f}%'} | "
            f"{median(stage, framework, 'peak_memory_mib'):.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", nargs="+", choices=sorted(FRAMEWORKS), default=list(FRAMEWORKS))
    parser.add_argument("--frameworks", nargs="+", help="only these (default: every one of each stage)")
    parser.add_argument("--model", default="llama-20m", help="a built-in shape (trainers/models/builtin.py)")
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--rows-per-step", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (training), bf16 weights (reference pass)")
    parser.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak, for MFU (GPUs: by name)")
    parser.add_argument("--trl", type=Path, default=PROJECT / ".bench" / "trl", help="where TRL is installed")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    options.device_kind = "cuda" if torch.cuda.is_available() else "cpu"
    if options.child:
        stage, framework = options.child.split(":")
        print(json.dumps(run_child(stage, framework, options)))
        return
    runs = [
        (stage, framework)
        for stage in options.stages
        for framework in FRAMEWORKS[stage]
        if options.frameworks is None or framework in options.frameworks
    ]
    results = []
    for _ in range(options.rounds):  # interleaved: each round runs every (stage, framework) once
        for stage, framework in runs:
            results.append(child_process(stage, framework, options))
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    print(json.dumps(results, indent=1) if options.json else table(results, options))


if __name__ == "__main__":
    main()
