"""GRPO: time per optimizer step and the share spent generating, for several
``steps_per_generation`` at an equal number of samples per optimizer step.

Every setting trains the same optimizer steps on the same micro-batches (per-device batch ×
accumulation completions per step); only how many micro-batches one ``generate`` call serves
changes, so generation calls must fall exactly by the ``steps_per_generation`` factor.

    .venv/bin/python benchmarks/grpo.py                      # built-in tiny model, fresh weights
    .venv/bin/python benchmarks/grpo.py --model PATH         # any causal LM checkpoint folder
    .venv/bin/python benchmarks/grpo.py --vocab-size 32000   # the tiny model with a real LLM's vocabulary

With ``--backend hf vllm`` (run from ``.venv-vllm``, ``make install-vllm``) each setting runs with
both generation backends, interleaved in the same repeats; ``builtin:llama-20m`` is the
20M-parameter Llama (vocabulary 16,384, hidden 384, 8 layers) on which generation dominates:

    .venv-vllm/bin/python benchmarks/grpo.py --backend hf vllm --model builtin:llama-20m --max-completion-length 64 \
        --steps-per-generation 4 --batch-size 32 --accumulation 4
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time

import datasets
import torch

from trainers.data.rows import Truncation, tokenize_split
from trainers.data.synthetic import AdditionTask, generate_addition
from trainers.grpo.trainer import GRPOConfig, GRPOTrainer
from trainers.models.builtin import build_builtin_model
from trainers.models.pretrained import load_causal_lm

# A benchmark's trainer: no reporting, no checkpoints, no progress bars, no pinned memory.
QUIET = dict(report_to=[], save_strategy="no", disable_tqdm=True, dataloader_pin_memory=False)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny-llama", help="builtin:tiny-llama or a checkpoint folder")
    parser.add_argument(
        "--vocab-size",
        type=int,
        help="resize the model's (tied) embeddings to this many tokens, e.g. 32000 as in real LLMs: the "
        "output projection and log-softmax then cost what they cost there (the tokenizer is unchanged)",
    )
    parser.add_argument("--backend", nargs="+", default=["hf"], choices=["hf", "vllm"], help="generation backends")
    parser.add_argument("--steps-per-generation", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--optimizer-steps", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=16, help="per-device completions per micro-batch")
    parser.add_argument("--accumulation", type=int, default=8)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=6)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=3, help="runs per setting; the median run is reported")
    return parser.parse_args()


def load(options: argparse.Namespace):
    source = options.model
    model, tokenizer = build_builtin_model(source, seed=0) if source.startswith("builtin:") else load_causal_lm(source)
    if options.vocab_size:
        torch.manual_seed(0)  # the new rows are random: the same in every run
        model.resize_token_embeddings(options.vocab_size, mean_resizing=False)
    return model, tokenizer


def run(
    options: argparse.Namespace, steps_per_generation: int, backend: str, prompts: datasets.Dataset, output_dir: str
) -> dict:
    model, tokenizer = load(options)
    args = GRPOConfig(
        output_dir=output_dir,
        **QUIET,
        per_device_train_batch_size=options.batch_size,
        gradient_accumulation_steps=options.accumulation,
        steps_per_generation=steps_per_generation,
        num_generations=options.num_generations,
        max_completion_length=options.max_completion_length,
        max_steps=options.optimizer_steps,
        logging_steps=options.optimizer_steps,
        learning_rate=1e-4,
        generation_backend=backend,
    )
    trainer = GRPOTrainer(model=model, args=args, train_dataset=prompts, processing_class=tokenizer)
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    (window,) = [log for log in trainer.state.log_history if "time/generation_per_step" in log]
    generation = window["time/generation_per_step"]
    step = generation + window["time/training_per_step"]
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "backend": backend,
        "peak_rss_mib": peak_mib,
        "steps_per_generation": steps_per_generation,
        "generate_calls": trainer.generation_calls,
        "samples": options.optimizer_steps * options.batch_size * options.accumulation,
        "seconds_per_step": step,
        "generation_seconds_per_step": generation,
        "generation_share": generation / step,
        "train_seconds": seconds,
    }


def main() -> None:
    options = parse_args()
    torch.set_num_threads(options.threads)
    shape, tokenizer = load(options)  # the model of the table's header
    rows = generate_addition(AdditionTask())["grpo_prompts"]
    prompts = datasets.Dataset.from_list(tokenize_split(rows, "grpo_prompts", tokenizer, Truncation(32, 16))[0])
    with tempfile.TemporaryDirectory() as output_dir:
        for backend in options.backend:  # warm-up: imports, allocator, kernels
            run(options, options.steps_per_generation[0], backend, prompts, output_dir)
        results = []
        for spg in options.steps_per_generation:
            runs: dict[str, list[dict]] = {backend: [] for backend in options.backend}
            for _ in range(options.repeats):  # the backends interleaved: drift in the machine's load hits both
                for backend in options.backend:
                    runs[backend].append(run(options, spg, backend, prompts, output_dir))
            for backend_runs in runs.values():
                backend_runs.sort(key=lambda r: r["seconds_per_step"])
                results.append(backend_runs[len(backend_runs) // 2])
    print(
        f"model {options.model} (vocabulary {shape.config.vocab_size}), {options.threads} threads, "
        f"per-device batch {options.batch_size} × accumulation "
        f"{options.accumulation}, G = {options.num_generations}, max {options.max_completion_length} new tokens, "
        f"{options.optimizer_steps} optimizer steps, median of {options.repeats} runs\n"
    )
    print(
        "| backend | steps_per_generation | generate calls | samples | s / "
        "optimizer step | generating s / step | generation share | peak RSS MiB (process so far) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['backend']} | {r['steps_per_generation']} | {r['generate_calls']} | {r['samples']} | "
            f"{r['seconds_per_step']:.3f} | {r['generation_seconds_per_step']:.3f} | {r['generation_share']:.0%} | "
            f"{r['peak_rss_mib']:.0f} |"
        )
    baseline = results[0]["generate_calls"]
    for r in results:
        factor = r["steps_per_generation"] // results[0]["steps_per_generation"]
        assert r["generate_calls"] * factor == baseline, f"generate calls did not fall by {factor}: {r}"


if __name__ == "__main__":
    main()
