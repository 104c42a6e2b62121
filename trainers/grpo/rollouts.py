"""Where GRPO's completions come from: one :class:`GenerationBackend` per ``generation_backend``.

``hf`` samples with the policy's own ``generate`` (:class:`PolicyBackend`); ``vllm`` with a vLLM
engine fed the policy's weights once per generation round, in this process or on a server
(:class:`EngineBackend`). The trainer asks its backend for each generation batch and owns what the
batch becomes (stop cuts, rewards, advantages); a new backend is a class and an entry in
:data:`GENERATION_BACKENDS`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, cast

import torch

from trainers.data.collators import pad_left
from trainers.generation.token_sampling import sampled_generation_config, sampling_processors
from trainers.generation.vllm_engine import (
    ColocatedEngine,
    SamplingOptions,
    SyncedEngine,
    require_vllm,
    serving_weights,
)
from trainers.generation.vllm_server import ServerEngine
from trainers.grpo.section import GenerationBackendName, VllmMode
from trainers.models.lora import has_adapters
from trainers.runtime.parameter_sharding import sampling_model

if TYPE_CHECKING:
    from transformers import GenerationMixin

    from trainers.grpo.trainer import GRPOConfig, GRPOTrainer


@dataclass(frozen=True)
class Rollouts:
    """Sampled completion tokens ``[N, L]`` (shorter rows padded with a stop token), the version of the
    policy that sampled them (its optimizer steps) and, when an engine sampled them, each token's
    log-prob under the engine's sampling distribution (0 on padding)."""

    tokens: torch.Tensor
    version: int
    engine_logps: torch.Tensor | None = None


def completion_seed(seed: int, generation: int, row: int) -> int:
    """The seed of completion ``row`` of generation batch ``generation`` (1-based): ``seed``,
    ``generation`` and ``row`` packed into one 63-bit integer, distinct for every pair below 2²⁰ rows."""
    return (seed * 1_000_003 + generation) * 2**20 + row


class GenerationBackend(ABC):
    """Samples the completions of a :class:`~trainers.grpo.trainer.GRPOTrainer`'s generation batches. It reads
    the trainer's state as it is at each call (its arguments, processes, sharding, step and
    ``generation_calls``, which the trainer counts before each batch)."""

    def __init__(self, trainer: GRPOTrainer):
        self.trainer = trainer

    def start(self, model) -> None:  # noqa: B027 (a hook: nothing to start by default)
        """What must be ready before a batch is sampled, done outside ``time/generation``."""

    @abstractmethod
    def sample(self, model, prompts: list[list[int]]) -> Rollouts:
        """Completion tokens ``[N, ≤ max_completion_length]`` for this process's ``prompts``."""

    def close(self) -> None:  # noqa: B027 (a hook: nothing to close by default)
        """Give back what :meth:`start` took, at the end of training."""

    def seeds(self, generation_seed: int, count: int, ahead: int = 0) -> list[int]:
        """:func:`completion_seed` (of ``generation_seed``) of each of this process's ``count`` rows, by
        its place in the generation batch over all processes (``count`` rows on each); of the batch
        ``ahead`` batches after the one the trainer counts now."""
        calls, first = self.trainer.generation_calls + ahead, self.trainer.accelerator.process_index * count
        return [completion_seed(generation_seed, calls, first + row) for row in range(count)]


class PolicyBackend(GenerationBackend):
    """The policy's own ``generate`` (eval mode, no grad, KV cache); with sharded parameters every
    process generates in lockstep (trainers/runtime/parameter_sharding.py), each as many calls as the others."""

    def __init__(self, trainer: GRPOTrainer):
        super().__init__(trainer)
        args = trainer.args
        self.processors = sampling_processors(args.temperature, args.top_k, args.top_p)
        self.config = sampled_generation_config(
            args.max_completion_length, trainer.processing_class.pad_token_id, trainer.stop_ids
        )

    def sample(self, model, prompts: list[list[int]]) -> Rollouts:
        """Completions of left-padded prompts; with ``generation_seed`` each sampled alone under its own
        seed (:meth:`sample_seeded`)."""
        trainer = self.trainer
        with sampling_model(model, trainer.accelerator, trainer.sharding) as unwrapped:
            if trainer.args.generation_seed is not None:
                completions = self.sample_seeded(unwrapped, prompts)
            else:
                input_ids, attention_mask = pad_left(prompts, trainer.processing_class.pad_token_id)
                output = cast("GenerationMixin", unwrapped).generate(  # a causal LM (or a PeftModel around one)
                    input_ids=input_ids.to(trainer.accelerator.device),
                    attention_mask=attention_mask.to(trainer.accelerator.device),
                    generation_config=self.config,
                    synced_gpus=trainer.sharding.lockstep,
                    logits_processor=self.processors,
                )
                completions = output[:, input_ids.shape[1] :].cpu()
        return Rollouts(completions, trainer.state.global_step)

    def sample_seeded(self, model, prompts: list[list[int]]) -> torch.Tensor:
        """Each completion generated alone under the seed :func:`completion_seed` of its place in the
        generation batch over all processes, so it depends on neither the process count nor its
        neighbours. Shorter rows are padded with a stop token (cut at the first one later); the global
        RNG state is left as it was."""
        trainer = self.trainer
        assert trainer.args.generation_seed is not None  # sample() calls this only with one
        device = trainer.accelerator.device
        rows = []
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            for prompt, seed in zip(prompts, self.seeds(trainer.args.generation_seed, len(prompts))):
                torch.manual_seed(seed)
                input_ids = torch.tensor([prompt], device=device)
                output = model.generate(
                    input_ids=input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    generation_config=self.config,
                    logits_processor=self.processors,
                    synced_gpus=trainer.sharding.lockstep,
                )
                rows.append(output[0, len(prompt) :].cpu())
        width = max(len(row) for row in rows)
        stop = trainer.stop_ids[0]
        return torch.stack([torch.cat([row, row.new_full((width - len(row),), stop)]) for row in rows])


def colocated_engine(trainer: GRPOTrainer, policy: torch.nn.Module, weights: dict[str, torch.Tensor]) -> SyncedEngine:
    """An engine in this process, on its device."""
    args = trainer.args
    return ColocatedEngine(policy, weights, args.engine_options, args.seed, trainer.state.global_step)


def server_engine(trainer: GRPOTrainer, policy: torch.nn.Module, weights: dict[str, torch.Tensor]) -> SyncedEngine:
    """The server at ``vllm_server_url``, rank 0 pushing the weights (``vllm_weight_transfer``)."""
    args = trainer.args
    if args.vllm_server_url is None:
        raise ValueError("vllm_mode: server needs vllm_server_url")
    assert args.output_dir is not None  # TrainingArguments sets it
    return ServerEngine(
        policy,
        weights,
        args.engine_options,
        args.seed,
        trainer.state.global_step,
        url=args.vllm_server_url,
        transfer=args.vllm_weight_transfer,
        folder=Path(args.vllm_transfer_folder or Path(args.output_dir) / "vllm-transfer"),
        pushes=trainer.accelerator.is_main_process,
        barrier=trainer.accelerator.wait_for_everyone,
    )


def vllm_here(args: GRPOConfig) -> None:
    require_vllm()  # only a colocated engine needs vLLM in the trainer's environment


def server_named(args: GRPOConfig) -> None:
    if args.vllm_server_url is None:
        raise ValueError(
            "vllm_mode server: vllm_server_url names no server (the pipeline's train task starts one; "
            "outside it, start `alignflow vllm-server` and give its address)"
        )


@dataclass(frozen=True)
class EngineMode:
    """Where an :class:`EngineBackend`'s engine runs (``vllm_mode``): what the trainer's arguments
    must give it (checked when the backend is made) and how the engine is built."""

    check: Callable[[GRPOConfig], None]
    build: Callable[[GRPOTrainer, torch.nn.Module, dict[str, torch.Tensor]], SyncedEngine]


ENGINE_MODES: dict[VllmMode, EngineMode] = {
    "colocate": EngineMode(vllm_here, colocated_engine),
    "server": EngineMode(server_named, server_engine),
}


class EngineBackend(GenerationBackend):
    """A vLLM engine (``vllm_mode``, :data:`ENGINE_MODES`: colocated in this process, or a server at
    ``vllm_server_url``), built from the policy at the first generation and fed its weights again
    before each round that follows an optimizer step; each completion under its own seed
    (:meth:`completion_seeds`)."""

    def __init__(self, trainer: GRPOTrainer):
        super().__init__(trainer)
        args = trainer.args
        self.mode = ENGINE_MODES[args.vllm_mode]
        self.mode.check(args)
        self.engine: SyncedEngine | None = None  # built at the first generation
        self.options = SamplingOptions(
            args.temperature, args.top_k, args.top_p, args.max_completion_length, trainer.stop_ids
        )

    def start(self, model) -> None:
        """Build the engine from the policy as it is now, unless it is built; its start-up is logged
        once as ``time/engine_start``."""
        self.built(model)

    def built(self, model) -> SyncedEngine:
        if self.engine is not None:
            return self.engine
        started = time.perf_counter()
        with self.policy_weights(model) as weights:  # whole, on every process, where they are sharded
            self.engine = self.mode.build(self.trainer, self.trainer.accelerator.unwrap_model(model), weights)
        self.trainer.window["time/engine_start"].append(time.perf_counter() - started)
        return self.engine

    def sample(self, model, prompts: list[list[int]]) -> Rollouts:
        """Completions and their engine log-probs, the engine's weights synced to the policy's first if
        an optimizer step changed them."""
        self.sync(model)
        return self.sample_synced(prompts, self.completion_seeds(len(prompts)))

    def sync(self, model) -> None:
        """The engine ready, holding the policy's weights as they are now (pushed if an optimizer step
        changed them; gathered only then: the first round samples the weights the engine was built from)."""
        engine = self.built(model)
        step = self.trainer.state.global_step
        if engine.holds(step):
            engine.wake({}, step)
        else:
            with self.policy_weights(model) as weights:
                engine.wake(weights, step)

    def sample_synced(self, prompts: list[list[int]], seeds: list[int]) -> Rollouts:
        """Completions of ``prompts`` under ``seeds`` from the weights the engine holds (:meth:`sync`).
        Reads nothing of the trainer's that a training step changes: a thread may run it while the trainer trains."""
        assert self.engine is not None  # synced first
        version = self.engine.synced_step
        samples = self.engine.generate(prompts, seeds, self.options)
        self.engine.rest()
        tokens, logps = samples.padded(self.trainer.stop_ids[0])
        return Rollouts(tokens, version, logps)

    @contextmanager
    def policy_weights(self, model) -> Iterator[dict[str, torch.Tensor]]:
        """The policy's weights as the engine loads them: whole parameters (gathered when sharded),
        or a LoRA policy's merged weights (:func:`~trainers.generation.vllm_engine.serving_weights`)."""
        unwrapped = self.trainer.accelerator.unwrap_model(model)
        if has_adapters(unwrapped):
            yield serving_weights(unwrapped)
            return
        with self.trainer.sharding.full_parameters(model) as weights:
            yield weights

    def completion_seeds(self, count: int, ahead: int = 0) -> list[int]:
        """One seed per completion: with ``generation_seed``, :func:`completion_seed` of its place in the
        generation batch over all processes (the batch ``ahead`` batches after the trainer's current
        one); otherwise drawn from this process's torch generator."""
        seed = self.trainer.args.generation_seed
        if seed is None:
            return torch.randint(0, 2**62, (count,)).tolist()
        return self.seeds(seed, count, ahead)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()  # its memory back before evaluation; the sync count stays readable


GENERATION_BACKENDS: dict[GenerationBackendName, type[GenerationBackend]] = {"hf": PolicyBackend, "vllm": EngineBackend}
