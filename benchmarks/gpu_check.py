"""GPU check: SFT → cached reference → DPO, DPO with LoRA, KTO → reward → GRPO → distill → evaluation
of a ~0.5B Llama, in bf16, on one GPU.

One prepared script, no network: it builds ``builtin:llama-0.5b`` (Qwen2.5-0.5B's shape, 494M
parameters, random init) and the built-in tokenizer, prepares the built-in addition task, and runs
every stage through the pipeline's own code (stage builders, ``tasks.reference.compute_columns``
and the cache, ``tasks.evaluate.score_model``) with ``compute.mixed_precision: bf16`` (training)
and ``compute.dtype: bfloat16`` for the reference pass and the evaluation. Per stage it prints
wall time, tokens/s, MFU and peak GPU memory, and it asserts that the reference pass and the
evaluation ran on the GPU (the GPU memory they allocated holds at least the model's bf16 weights).
GRPO is scored by the reward stage's model on a device of its own (``grpo.reward_model_device:
cpu``) and the distillation's teacher (the SFT model) runs on the CPU too (``distill.teacher_device:
cpu``): their inputs, scores and logits cross devices. DPO with LoRA adapters (peft, on the cached
reference) and KTO (a live reference model) start from the SFT model beside DPO.

    .venv/bin/python benchmarks/gpu_check.py                      # on a CUDA machine (a few minutes)
    .venv/bin/python benchmarks/gpu_check.py --model builtin:tiny-llama --steps 2 --allow-cpu   # logic smoke
    .venv/bin/python benchmarks/gpu_check.py --sharding fsdp --processes 2   # or zero3 (pip install deepspeed)
    .venv/bin/python benchmarks/gpu_check.py --shape chat        # chat shapes beside TRL (benchmarks/chat_shapes.py)
    .venv-vllm/bin/python benchmarks/gpu_check.py --backend vllm   # GRPO's rollouts and the evaluation on vLLM
    .venv-vllm/bin/python benchmarks/gpu_check.py --backend vllm --vllm-mode server   # GRPO on a managed server

With ``--backend vllm`` GRPO's engine is colocated in the training process, in sleep mode on a GPU
(its memory given back between generations; each sync lands on woken weights), or with
``--vllm-mode server`` it is a vLLM server started for the stage on this machine (the trainer's
weights by shared storage; on one GPU the server shares it, ``vllm_gpu_memory_utilization`` each).
Either way the printed on-policy |Δ logp| says whether the engine sampled from the synced weights.

``--sharding fsdp|zero3|ddp`` runs instead the check of sharded parameters
(benchmarks/sharded_check.py) under ``accelerate launch`` with infra/core/accelerate's config: GRPO
generation, the live reference and the TR-DPO sync of the stages' own trainers, on ``--processes``
GPUs (1 is enough to run the sharded code paths); ``ddp --allow-cpu`` smokes its logic on the CPU.

MFU = achieved FLOP/s ÷ the device's peak dense bf16 FLOP/s (``--peak-tflops``; known GPUs are
looked up by name). Achieved FLOPs count 6·N per training token (forward and backward) and 2·N per
forward-only token (reference pass), N = the model's parameters (tied embeddings once, so the
output projection is included); attention's sequence-quadratic term is left out (sequences here
are ≤ 32 tokens: under 1%). GRPO's count is its training tokens only, while its wall time also
holds generation: its MFU is a lower bound.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

# --sharding: the accelerate config and the parameter sharding (trainers/runtime/parameter_sharding.py) it gives.
SHARDING_CHECKS = {"ddp": "replicated", "fsdp": "fsdp2", "zero3": "zero3"}
# Dense bf16 peak TFLOP/s (no sparsity) of the GPUs a team is likely to have.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "L4": 121.0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:llama-0.5b", help="a built-in model: builtin:llama-0.5b, …")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per training stage")
    parser.add_argument("--batch-size", type=int, default=64, help="per-device rows (SFT, DPO pairs, GRPO completions)")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--eval-prompts", type=int, default=256)
    parser.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak (default: looked up by name)")
    parser.add_argument("--allow-cpu", action="store_true", help="run on the CPU without a GPU (a smoke of the logic)")
    parser.add_argument("--sharding", choices=sorted(SHARDING_CHECKS), help="check sharded parameters instead")
    parser.add_argument(
        "--shape",
        choices=["addition", "chat"],
        default="addition",
        help="chat: instead of the pipeline's stages, SFT, DPO, the reference pass and GRPO's training pass at "
        "chat shapes, alignflow padded, padding-free and TRL side by side (benchmarks/chat_shapes.py)",
    )
    parser.add_argument("--max-length", type=int, default=1024, help="--shape chat: the longest row, in tokens")
    parser.add_argument("--chat-rows", type=int, default=16, help="--shape chat: rows (DPO: pairs) per step")
    parser.add_argument("--without-trl", action="store_true", help="--shape chat: alignflow's rows only")
    parser.add_argument("--processes", type=int, default=1, help="processes (GPUs) of the --sharding check")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (models, caches; GBs) at the end")
    parser.add_argument(
        "--backend",
        choices=["hf", "vllm"],
        default="hf",
        help="GRPO's and the evaluation's generation backend (vllm: a machine with vLLM installed)",
    )
    parser.add_argument(
        "--vllm-mode",
        choices=["colocate", "server"],
        default="colocate",
        help="--backend vllm: GRPO's engine in the training process (sleep mode on a GPU) or a managed vLLM server",
    )
    return parser.parse_args(argv)


@dataclass
class StageReport:
    name: str
    seconds: float
    tokens: int
    flops_per_token: int  # 6·N training, 2·N forward only
    peak_memory: int | None  # bytes; None on the CPU
    added_memory: int | None  # peak minus what was allocated when the stage started

    def row(self, peak_flops: float | None) -> str:
        rate = self.tokens / self.seconds
        mfu = f"{100 * rate * self.flops_per_token / peak_flops:.2f}%" if peak_flops else "n/a"
        memory = f"{self.peak_memory / 2**30:.2f}" if self.peak_memory is not None else "n/a"
        return f"| {self.name} | {self.seconds:.1f} | {self.tokens} | {rate:,.0f} | {mfu} | {memory} |"


class TokenCounter:
    """Non-padding tokens of the forward passes a model runs in training mode (not generation): its
    ``attention_mask``'s ones, or, packed (no mask), the ids other than ``pad_token_id`` (a pack's filler
    slots hold id 0, the built-in tokenizer's padding, which no real row holds)."""

    def __init__(self, model, pad_token_id: int):
        self.tokens, self.pad_token_id = 0, pad_token_id
        self.handle = model.register_forward_pre_hook(self.count, with_kwargs=True)

    def count(self, module, args, kwargs):
        if not module.training:
            return
        mask = kwargs.get("attention_mask")
        if mask is not None:
            self.tokens += int(mask.sum())
        elif kwargs.get("position_ids") is not None:
            self.tokens += int(kwargs["input_ids"].ne(self.pad_token_id).sum())


@contextmanager
def measured(name: str, flops_per_token: int, reports: list[StageReport], gpu: bool):
    """Time the block and its peak GPU memory; the block sets ``box["tokens"]``."""
    import torch

    if gpu:
        gc.collect()  # the previous stage's trainer
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated() if gpu else 0
    box = {"tokens": 0}
    started = time.perf_counter()
    yield box
    if gpu:
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() if gpu else None
    added = peak - baseline if gpu else None
    reports.append(StageReport(name, time.perf_counter() - started, box["tokens"], flops_per_token, peak, added))
    print(f"gpu_check: {name} done in {reports[-1].seconds:.1f} s", flush=True)


def peak_flops(options: argparse.Namespace, gpu: bool) -> float | None:
    import torch

    if options.peak_tflops:
        return options.peak_tflops * 1e12
    if not gpu:
        return None
    name = torch.cuda.get_device_name()
    known = next((tflops for key, tflops in PEAK_BF16_TFLOPS.items() if key in name), None)
    return known * 1e12 if known else None


def pair_token_count(rows) -> int:
    """Tokens of the reference forward over pairs: prompt + chosen and prompt + rejected."""
    return sum(len(r["prompt_ids"]) * 2 + len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in rows)


def train_stage(
    stage: str,
    section,
    inputs,
    reports,
    parameters: int,
    gpu: bool,
    logs: dict | None = None,
    name: str | None = None,
):
    """Build the stage with the pipeline's builder, train it, save its model (LoRA: its adapters);
    its handle (and its trainer's last log window in ``logs``). ``name``: its row in the table.
    With LoRA a token costs 4·N (no weight gradients of the frozen model), else 6·N."""
    from tasks.models import checkpoint_handle
    from trainers.catalog import STAGES

    trainer = STAGES[stage].build(section, inputs)
    counter = TokenCounter(trainer.model, trainer.processing_class.pad_token_id)
    flops_per_token = (6 if inputs.lora is None else 4) * parameters
    with measured(name or stage, flops_per_token, reports, gpu) as box:
        trainer.train()
        box["tokens"] = counter.tokens
    counter.handle.remove()
    if logs is not None:
        logs.update(next(entry for entry in reversed(trainer.state.log_history) if "loss" in entry))
    model_dir = Path(inputs.output_dir) / "model"
    trainer.save_model(str(model_dir))
    return checkpoint_handle(model_dir, stage)


def main(argv: list[str] | None = None) -> int:
    options = parse_args(argv)
    import torch

    gpu = torch.cuda.is_available()
    if not gpu and not options.allow_cpu:
        print(
            "gpu_check: no CUDA device on this machine; this check needs one GPU. For a smoke run of its logic on "
            "the CPU: --model builtin:tiny-llama --steps 2 --allow-cpu",
            file=sys.stderr,
        )
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="alignflow-gpu-check-"))
    os.environ["ALIGNFLOW_HOME"] = str(workdir / "state")  # caches and data of this check only
    from infra.core.settings import configure_environment

    configure_environment()
    try:
        if options.shape == "chat":
            return run_chat_shapes(options, gpu)
        return run_sharding_check(options, gpu, workdir) if options.sharding else run_check(options, gpu, workdir)
    finally:
        if options.keep:
            print(f"gpu_check: the work folder is kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)  # about 8 GB with the default model


def run_chat_shapes(options: argparse.Namespace, gpu: bool) -> int:
    """``benchmarks/chat_shapes.py`` on this machine's GPU (bf16 autocast; the CPU in float32 with
    ``--allow-cpu``): every stage it measures, each framework in a process of its own. Without TRL
    (``import trl`` or ``.bench/trl``), alignflow's rows only, and a note."""
    import importlib.util

    import chat_shapes

    argv = [
        *("--model", options.model.removeprefix("builtin:"), "--max-length", str(options.max_length)),
        *("--rows-per-step", str(options.chat_rows), "--steps", str(options.steps), "--warmup", "1"),
    ]
    if gpu:
        argv.append("--bf16")
    if options.peak_tflops:
        argv += ["--peak-tflops", str(options.peak_tflops)]
    trl = importlib.util.find_spec("trl") is not None or (chat_shapes.PROJECT / ".bench" / "trl").is_dir()
    if not trl:
        print("gpu_check: TRL is not installed (benchmarks/chat_shapes.py says how): alignflow's rows only")
    if options.without_trl or not trl:
        argv += ["--frameworks", "alignflow-padded", "alignflow"]
    chat_shapes.main(argv)
    return 0


def run_sharding_check(options: argparse.Namespace, gpu: bool, workdir: Path) -> int:
    """benchmarks/sharded_check.py in every process of an ``accelerate launch`` with the sharding's config."""
    import json
    import subprocess

    from infra.core.config import ComputeConfig, launcher_temp_folder
    from trainers.models.builtin import save_builtin_model

    if not gpu and options.sharding != "ddp":
        print("gpu_check: accelerate runs FSDP and DeepSpeed on GPUs only; on the CPU: --sharding ddp", file=sys.stderr)
        return 2
    model = save_builtin_model(options.model, 0, workdir / "base")
    spec = {
        "model": str(model),
        "output_dir": str(workdir / "sharded"),
        "sharding": SHARDING_CHECKS[options.sharding],
        "world_size": options.processes,
        "steps": options.steps,
        "cpu": not gpu,
    }
    compute = ComputeConfig(
        cpu=not gpu,
        num_processes=options.processes,
        mixed_precision="bf16" if gpu else "no",
        accelerate_config=options.sharding if gpu else None,
    )
    root = Path(__file__).resolve().parents[1]
    # ahead of the caller's own PYTHONPATH (a machine's carried packages, say), which stays
    path = os.pathsep.join(filter(None, [str(root), str(root / "benchmarks"), os.environ.get("PYTHONPATH")]))
    env = os.environ | {"PYTHONPATH": path, **launcher_temp_folder(workdir / "tmp")}
    for stage in ("grpo", "dpo"):
        (workdir / f"{stage}.json").write_text(json.dumps(spec | {"stage": stage}))
        command = compute.launch_command(workdir / f"{stage}.json", module="sharded_check")
        done = subprocess.run(command, cwd=root, env=env)
        if done.returncode:
            return done.returncode
    print(f"gpu_check: generation, the live reference and the TR-DPO sync are correct under {options.sharding}")
    return 0


@contextmanager
def grpo_engine(options: argparse.Namespace, gpu: bool, workdir: Path) -> Iterator[tuple[dict, str]]:
    """GRPO's ``vllm_*`` settings for ``--backend``/``--vllm-mode``, and their name: none for hf;
    colocated, asleep between generations on a GPU; or the address of a vLLM server started on this
    machine for the block, fed by shared storage (``infra.core.generation_server``, as the train task
    starts one)."""
    if options.backend == "hf":
        yield {}, "hf"
    elif options.vllm_mode == "colocate":
        # vLLM's CPU backend has no sleep mode
        yield {"vllm_mode": "colocate", "vllm_enable_sleep_mode": gpu}, f"vllm colocated{' in sleep mode' * gpu}"
    else:
        from infra.core.generation_server import managed_generation_server

        folder = workdir / "vllm-transfer"
        with managed_generation_server(folder, lambda line: print(f"vllm-server: {line}", flush=True)) as url:
            settings = {"vllm_mode": "server", "vllm_server_url": url, "vllm_transfer_folder": str(folder)}
            yield settings, f"a vllm server (storage transfer, {url})"


def run_check(options: argparse.Namespace, gpu: bool, workdir: Path) -> int:
    import datasets
    from prefect.logging import disable_run_logger

    from infra.core.config import (
        AdditionTaskConfig,
        ComputeConfig,
        DataConfig,
        EvaluationConfig,
        check_compute,
        compute_device,
    )
    from infra.core.handles import ReferenceLogps
    from tasks.data import prepare_dataset
    from tasks.evaluate import Scoring, score_model
    from tasks.models import checkpoint_handle
    from tasks.reference import ensure_entry, with_reference_columns
    from trainers.catalog import ModelSource, StageInputs
    from trainers.distill.section import DistillStageConfig
    from trainers.dpo.section import DPOStageConfig
    from trainers.grpo.section import GRPOStageConfig
    from trainers.kto.section import KTOStageConfig
    from trainers.models.builtin import save_builtin_model
    from trainers.models.lora import LoraSettings
    from trainers.reward.section import RewardStageConfig
    from trainers.sft.section import SFTConfig

    compute = ComputeConfig(
        mixed_precision="bf16" if gpu else "no", dtype="bfloat16" if gpu else "float32", cpu=not gpu
    )
    check_compute(compute)
    device = compute_device(compute.cpu)
    assert device.type == ("cuda" if gpu else "cpu"), device
    base = checkpoint_handle(save_builtin_model(options.model, 0, workdir / "base"), "base")
    with disable_run_logger():
        data = prepare_dataset.fn(DataConfig(builtin=AdditionTaskConfig(num_eval_problems=options.eval_prompts)), base)
    import torch

    from trainers.models.pretrained import load_causal_lm

    parameters = sum(p.numel() for p in load_causal_lm(base.path)[0].parameters())
    weight_bytes = parameters * 2  # in bfloat16
    print(f"gpu_check: {options.model}, {parameters / 1e6:.0f}M parameters, on {device}", flush=True)
    reports: list[StageReport] = []
    steps = dict(max_steps=options.steps, logging_steps=options.steps, save_steps=0, eval_strategy="no")

    def inputs(stage: str, start, splits, **helpers) -> StageInputs:
        source = ModelSource(start.path)
        return StageInputs(
            policy=source,
            reference=source,
            splits=splits,
            output_dir=str(workdir / stage),
            dtype="float32",  # fp32 master weights; bf16 autocast through mixed_precision
            mixed_precision=compute.mixed_precision,
            cpu=compute.cpu,
            padding_free=compute.padding_free,
            **helpers,
        )

    splits = datasets.load_from_disk(data.path)
    sft = train_stage(
        "sft",
        SFTConfig(per_device_train_batch_size=options.batch_size, warmup_ratio=0.0, **steps),
        inputs("sft", base, splits),
        reports,
        parameters,
        gpu,
    )

    ref = ReferenceLogps(
        key="gpu-check", root=str(workdir / "refcache"), data=data, reference=sft, batch_size=128, dtype=compute.dtype
    )
    pair_tokens = sum(pair_token_count(splits[split]) for split in ("preference", "preference_eval"))
    with measured("reference pass", 2 * parameters, reports, gpu) as box:
        entry, computed = ensure_entry(ref)
        box["tokens"] = pair_tokens
    assert computed and entry.manifest["inputs"]["dtype"] == compute.dtype, entry.manifest["inputs"]
    if gpu:
        assert reports[-1].added_memory >= weight_bytes, "the reference pass did not run on the GPU"

    dpo = train_stage(
        "dpo",
        DPOStageConfig(per_device_train_batch_size=options.batch_size, **steps),
        inputs("dpo", sft, with_reference_columns(ref)),
        reports,
        parameters,
        gpu,
    )
    train_stage(
        "dpo",
        DPOStageConfig(per_device_train_batch_size=options.batch_size, **steps),
        inputs("dpo-lora", sft, with_reference_columns(ref), lora=LoraSettings()),
        reports,
        parameters,
        gpu,
        name="dpo (lora)",
    )
    train_stage(
        "kto",
        KTOStageConfig(per_device_train_batch_size=options.batch_size, reference="live", **steps),
        inputs("kto", sft, splits),
        reports,
        parameters,
        gpu,
    )
    reward = train_stage(
        "reward",
        RewardStageConfig(per_device_train_batch_size=options.batch_size, **steps),
        inputs("reward", sft, splits),
        reports,
        parameters,
        gpu,
    )
    grpo_logs: dict = {}
    with grpo_engine(options, gpu, workdir) as (engine, backend):
        grpo = train_stage(
            "grpo",
            GRPOStageConfig(
                per_device_train_batch_size=options.batch_size,
                num_generations=options.num_generations,
                log_completions_steps=0,
                generation_backend=options.backend,
                reward_funcs=["correctness", "model:reward"],
                reward_model_device="cpu",
                **engine,
                **{k: v for k, v in steps.items() if k != "eval_strategy"},
            ),
            inputs("grpo", dpo, splits, reward_models={"reward": ModelSource(reward.path)}),
            reports,
            parameters,
            gpu,
            grpo_logs,
        )
    assert "rewards/model:reward/mean" in grpo_logs, sorted(grpo_logs)
    generating, training = grpo_logs["time/generation_per_step"], grpo_logs["time/training_per_step"]
    tokens_per_second = grpo_logs["completions/mean_length"] * options.batch_size / generating
    gap = (
        f", on-policy |Δ logp| mean {grpo_logs['vllm/logp_diff_mean']:.2e}, max {grpo_logs['vllm/logp_diff_max']:.2e}"
        if options.backend == "vllm"
        else ""
    )
    print(
        f"gpu_check: GRPO on {backend}: {generating:.3f} s generating and {training:.3f} s training per "
        f"step, {tokens_per_second:,.0f} generated tokens/s{gap}"
    )

    train_stage(
        "distill",
        DistillStageConfig(
            teacher_model=sft.path,
            teacher_device="cpu",
            lmbda=0.0,  # every step on the teacher's own samples (seq_kd): generated on its device
            seq_kd=True,
            max_new_tokens=16,
            per_device_train_batch_size=options.batch_size,
            **steps,
        ),
        inputs("distill", base, splits, teacher=ModelSource(sft.path)),
        reports,
        parameters,
        gpu,
    )
    print("gpu_check: GRPO's reward model and the distillation's teacher ran on cpu")

    evaluation = EvaluationConfig(
        num_prompts=options.eval_prompts, bootstrap_resamples=100, generation_backend=options.backend
    )
    prompts = splits["eval_prompts"].to_list()[: options.eval_prompts]
    pairs = with_reference_columns(ref)["preference_eval"].to_list()
    with measured("evaluation", 2 * parameters, reports, gpu) as box:
        scores = score_model(grpo, Scoring(prompts, pairs, evaluation, 0.5, compute))
        box["tokens"] = sum(len(p["prompt_ids"]) for p in prompts) * (1 + evaluation.num_samples)  # prompt tokens
    if gpu:
        assert reports[-1].added_memory >= weight_bytes, "the evaluation did not run on the GPU"
    print(f"gpu_check: final greedy accuracy {scores.metrics['greedy_accuracy']:.3f} (random init: ~0 expected)")

    flops = peak_flops(options, gpu)
    device_name = torch.cuda.get_device_name() if gpu else "CPU"
    print(f"\n{options.model} on {device_name}, {options.steps} steps per stage, batch {options.batch_size}")
    print("| stage | wall (s) | tokens | tokens/s | MFU | peak GPU memory (GiB) |")
    print("|---|---|---|---|---|---|")
    for report in reports:
        print(report.row(flops))
    print("gpu_check: the reference pass and the evaluation ran on", device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
