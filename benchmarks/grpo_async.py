"""Asynchronous GRPO (``max_staleness``): time per optimizer step and generated tokens per second for
k = 0, 1, 2, with the rollouts on a managed vLLM server pinned to one core and the trainer on another.

Every run trains the same optimizer steps on the same shape; with k ≥ 1 the server samples the next
batches while the trainer trains, so a step costs the longer of the two instead of their sum. The
runs are interleaved over the repeats (drift in the machine's load hits all alike); the median run
per k is reported.

    .venv-vllm/bin/python benchmarks/grpo_async.py                                  # the 20M shape
    .venv-vllm/bin/python benchmarks/grpo_async.py --staleness 0 1 --repeats 1 --optimizer-steps 4
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import datasets
import torch
from grpo import QUIET  # benchmarks/grpo.py, beside this script

from infra.core.generation_server import managed_generation_server
from trainers.data.rows import Truncation, tokenize_split
from trainers.data.synthetic import AdditionTask, generate_addition
from trainers.grpo.trainer import GRPOConfig, GRPOTrainer
from trainers.models.builtin import build_builtin_model


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:llama-20m")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--optimizer-steps", type=int, default=8)
    parser.add_argument("--steps-per-generation", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32, help="completions per micro-batch")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=64)
    parser.add_argument("--trainer-core", type=int, default=0)
    parser.add_argument("--server-core", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2, help="runs per k; the median run is reported")
    return parser.parse_args()


def run(options: argparse.Namespace, staleness: int, prompts: datasets.Dataset, url: str, root: Path) -> dict:
    model, tokenizer = build_builtin_model(options.model, seed=0)
    with tempfile.TemporaryDirectory() as output_dir:
        args = GRPOConfig(
            output_dir=output_dir,
            **QUIET,
            per_device_train_batch_size=options.batch_size,
            steps_per_generation=options.steps_per_generation,
            num_generations=options.num_generations,
            max_completion_length=options.max_completion_length,
            max_steps=options.optimizer_steps,
            logging_steps=options.optimizer_steps,
            learning_rate=1e-4,
            generation_backend="vllm",
            vllm_mode="server",
            vllm_server_url=url,
            vllm_transfer_folder=str(root),
            vllm_importance_sampling_cap=3.0,
            max_staleness=staleness,
            generation_seed=0,
        )
        trainer = GRPOTrainer(
            model=model,
            args=args,
            train_dataset=prompts,
            processing_class=tokenizer,
            reward_funcs=[lambda prompts, completions, **_: [float(len(c) % 3) for c in completions]],
        )
        started = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - started
    (window,) = [log for log in trainer.state.log_history if "time/generation_per_step" in log]
    tokens = options.optimizer_steps * options.batch_size * window["completions/mean_length"]
    return {
        "staleness": staleness,
        "seconds_per_step": seconds / options.optimizer_steps,
        "waiting_per_step": window["time/generation_per_step"],
        "tokens_per_second": tokens / seconds,
        "steps_max": window.get("staleness/steps_max", 0.0),
        "taken": 0 if trainer.ahead is None else trainer.ahead.taken,
        "rounds": trainer.generation_calls,
    }


def main() -> None:
    options = parse_args()
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(options.server_core)  # the server's threads, on its core
    _, tokenizer = build_builtin_model(options.model, seed=0)
    rows = generate_addition(AdditionTask())["grpo_prompts"]
    prompts = datasets.Dataset.from_list(tokenize_split(rows, "grpo_prompts", tokenizer, Truncation(32, 16))[0])
    with tempfile.TemporaryDirectory() as folder, managed_generation_server(Path(folder), lambda line: None) as url:
        os.sched_setaffinity(0, {options.trainer_core})  # after the server started: it keeps its own core
        torch.set_num_threads(1)
        run(options, 0, prompts, url, Path(folder))  # warm-up: imports, allocator, the server's first engine
        runs: dict[int, list[dict]] = {k: [] for k in options.staleness}
        for _ in range(options.repeats):
            for k in options.staleness:
                runs[k].append(run(options, k, prompts, url, Path(folder)))
    print(
        f"model {options.model}, trainer on core {options.trainer_core} (1 thread), server on core "
        f"{options.server_core}; {options.optimizer_steps} optimizer steps of {options.batch_size} completions "
        f"(G = {options.num_generations}, ≤ {options.max_completion_length} tokens), steps_per_generation "
        f"{options.steps_per_generation}; median of {options.repeats} runs\n"
    )
    print(
        "| max_staleness | s / optimizer step | waiting for rollouts s / step | tokens / s | staleness max (steps) "
        "| rounds (taken ahead) | vs k = 0 |"
    )
    print("|---|---|---|---|---|---|---|")
    medians = {k: sorted(r, key=lambda run: run["seconds_per_step"])[len(r) // 2] for k, r in runs.items()}
    base = medians[options.staleness[0]]["seconds_per_step"]
    for k, r in medians.items():
        print(
            f"| {k} | {r['seconds_per_step']:.2f} | {r['waiting_per_step']:.2f} | {r['tokens_per_second']:.0f} | "
            f"{r['steps_max']:.0f} | {r['rounds']} ({r['taken']}) | {r['seconds_per_step'] / base:.2f}× |"
        )


if __name__ == "__main__":
    main()
