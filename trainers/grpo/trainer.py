"""``GRPOTrainer``: group-relative policy optimisation on a ``transformers.Trainer``.

Per generation batch (``generation_batch_size`` completions = prompts × ``num_generations``):
sample completions from the policy (eval mode, no grad, KV cache), cut each at its first stop
token (the model's EOS ids and its chat template's end of turn: :mod:`trainers.models.stop_tokens`), score
them with the reward functions, turn rewards into group-relative advantages, and, when the batch
is reused off-policy, record the sampling policy's log-probs. The batch is then served as
``steps_per_generation`` slices, each once per iteration (``num_iterations``), to the loss:
the per-token objective (``policy_loss``) of the importance ratio (``importance_sampling_level``),
plus the options that ask for it (entropy bonus, high-entropy token mask, ``β``·k3 KL to a frozen
reference when ``β > 0``: a copy of the initial policy, or a LoRA policy with its adapters
disabled), aggregated by ``loss_type``.
"""

from __future__ import annotations

import copy
import math
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Sequence, cast

import torch
from torch.utils.data import DataLoader
from transformers import PreTrainedModel, PreTrainedTokenizerBase, Trainer

from trainers.data.collators import prompt_completion_batch
from trainers.data.lengths import model_context, prompt_lengths
from trainers.generation.vllm_engine import EngineOptions
from trainers.grpo.ahead import AheadSampler
from trainers.grpo.layout import GenerationLayout
from trainers.grpo.losses import (
    IMPORTANCE_LEVELS,
    ObjectiveParams,
    PolicyObjective,
    bias_corrected_k3_kl,
    get_grpo_loss,
    get_policy_objective,
    group_advantages,
    high_entropy_mask,
    k3_kl,
    masked_mean,
    nan_std,
    normalized_advantages,
    sequence_kl,
    weighted_rewards,
)
from trainers.grpo.off_policy import MISMATCH_CORRECTIONS, off_policy_sequence_mask
from trainers.grpo.rewards import RewardError, RewardFunction, resolve_rewards, reward_kwargs, score_completions
from trainers.grpo.rollouts import GENERATION_BACKENDS, EngineBackend, Rollouts
from trainers.grpo.samplers import RepeatSampler, generation_dataloader
from trainers.grpo.section import (
    COMPLETIONS_LOG_KEY,
    GRPOStageConfig,
    check_engine_options,
    check_policy_options,
    generation_layout,
    grpo_generation,
)
from trainers.models.attention import packing_for
from trainers.models.lora import has_adapters, live_reference
from trainers.models.stop_tokens import cut_at_first_stop, stop_token_ids
from trainers.runtime.arguments import PassArguments
from trainers.runtime.parameter_sharding import forward_model, prepare_reference, sharding_of
from trainers.scoring.logprobs import next_token_logps
from trainers.sections import section_fields


@dataclass
@section_fields(GRPOStageConfig)
class GRPOConfig(PassArguments):
    """``PassArguments`` plus the GRPO section's fields, with its defaults. Build it from a
    section: ``GRPOStageConfig(...).training_arguments(GRPOConfig, output_dir=…)``, which also
    runs the section's checks. The fields keep their configured values; what follows from them
    and the number of processes is derived below (``layout``, ``upper_epsilon``)."""

    remove_unused_columns: bool = False  # the dataloader hands over raw prompt rows

    def __post_init__(self):
        super().__post_init__()
        self.layout  # noqa: B018  (check the batch arithmetic now, not at the first step)
        check_policy_options(self)
        check_engine_options(self)
        if self.max_staleness and self.world_size > 1:
            raise ValueError(
                f"max_staleness: {self.max_staleness} runs on one training process (not {self.world_size})"
            )

    @property
    def layout(self) -> GenerationLayout:
        """The generation layout over all processes (``steps_per_generation`` filled in)."""
        return generation_layout(self, self.world_size)

    @property
    def upper_epsilon(self) -> float:
        """ε_high of the clip, ``epsilon`` unless set."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def clip_range(self) -> tuple[float, float]:
        """``(ε_low, ε_high)`` of the importance level in use (``epsilon``/``epsilon_high`` per
        token, ``sequence_epsilon``/``sequence_epsilon_high`` for GSPO); ε_high defaults to ε_low."""
        low_field, high_field = IMPORTANCE_LEVELS.lookup(self.importance_sampling_level).clip_range
        low, high = getattr(self, low_field), getattr(self, high_field)
        return low, low if high is None else high

    @property
    def objective_params(self) -> ObjectiveParams:
        low, high = self.clip_range
        return ObjectiveParams(
            epsilon_low=low,
            epsilon_high=high,
            delta=self.delta,
            cispo_max_ratio=self.cispo_max_ratio,
            sapo_temperature_pos=self.sapo_temperature_pos,
            sapo_temperature_neg=self.sapo_temperature_neg,
        )

    @property
    def reuses_generations(self) -> bool:
        """Whether a generation batch outlives the policy that sampled it (off-policy reuse, or sampled ahead)."""
        return (
            self.layout.steps_per_generation > self.gradient_accumulation_steps
            or self.num_iterations > 1
            or self.max_staleness > 0
        )

    @property
    def engine_options(self) -> EngineOptions:
        return EngineOptions(
            gpu_memory_utilization=self.vllm_gpu_memory_utilization,
            max_model_len=self.vllm_max_model_len,
            enable_sleep_mode=self.vllm_enable_sleep_mode,
            cpu_kv_cache_gib=self.vllm_cpu_kv_cache_gib,
        )


def token_position_values(prompts: list[list[int]], completions: list[list[int]], values: torch.Tensor) -> torch.Tensor:
    """``values[i, j]`` (one per sampled completion token) placed at that token's position in the
    ``prompt + completion`` rows of :func:`completion_batch` (0 elsewhere), so they are sliced with
    ``input_ids``; position ``t`` holds the value of token ``t``, predicted at ``t − 1``."""
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    placed = torch.zeros(len(prompts), width, dtype=values.dtype)
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        placed[row, len(prompt) : len(prompt) + len(completion)] = values[row, : len(completion)]
    return placed


def is_max_metric(name: str) -> bool:
    """A ``…_max`` metric takes the max over processes and over the logging window; others the mean."""
    return name.endswith("_max")


def is_min_metric(name: str) -> bool:
    """A ``…_min`` metric takes the min over processes and over the logging window."""
    return name.endswith("_min")


def window_value(name: str, values: list[float]) -> float:
    """A metric's value over its logging window: the max, the min, or the mean (by its name)."""
    return max(values) if is_max_metric(name) else min(values) if is_min_metric(name) else sum(values) / len(values)


def prompt_ids(row: dict, limit: int | None) -> list[int]:
    """A prompt row's token ids as GRPO samples from them: the last ``limit`` (``max_prompt_length``)."""
    return row["prompt_ids"][-limit:] if limit else row["prompt_ids"]


def keep_rows(features: list[dict]) -> list[dict]:
    """The dataloader hands over raw rows; tensors are built after generation."""
    return features


def completion_batch(
    prompts: list[list[int]],
    generated: torch.Tensor,
    stop_ids: tuple[int, ...],
    pad_token_id: int,
    mask_truncated: bool,
) -> tuple[dict[str, torch.Tensor], list[list[int]], list[bool]]:
    """Right-padded ``prompt + completion`` rows (the positions the policy sampled them at), the
    completions cut at their first stop token (:mod:`trainers.models.stop_tokens`) and which were truncated.
    ``completion_mask`` covers the completion up to and including its stop token; with
    ``mask_truncated`` a truncated row counts no token."""
    completions, truncated = cut_at_first_stop(generated, stop_ids)
    batch = prompt_completion_batch(prompts, completions, pad_token_id)
    if mask_truncated:
        batch["completion_mask"][torch.tensor(truncated, dtype=torch.bool)] = 0
    return batch, completions, truncated


class GenerationBuffer:
    """One generation batch as slices, served in order, each once per iteration; then empty."""

    def __init__(self, num_iterations: int):
        self.num_iterations = num_iterations
        self.slices: list[dict[str, torch.Tensor]] = []
        self.served = 0

    @property
    def is_empty(self) -> bool:
        return self.served >= len(self.slices) * self.num_iterations

    def fill(self, slices: list[dict[str, torch.Tensor]]) -> None:
        self.slices, self.served = slices, 0

    def next_slice(self) -> dict[str, torch.Tensor]:
        batch = self.slices[self.served % len(self.slices)]
        self.served += 1
        return batch

    def state_dict(self) -> dict:
        return {"slices": self.slices, "served": self.served}

    def load_state_dict(self, state: dict) -> None:
        self.slices, self.served = state["slices"], state["served"]


class GRPOTrainer(Trainer):
    args: GRPOConfig
    model: PreTrainedModel  # or a PeftModel around one, which forwards its attributes
    processing_class: PreTrainedTokenizerBase  # checked in __init__
    stop_ids: tuple[int, ...]
    objective: PolicyObjective

    def __init__(
        self,
        *trainer_args,
        ref_model: PreTrainedModel | None = None,
        reward_funcs: Sequence[str | RewardFunction] | None = None,
        **kwargs,
    ):
        """``ref_model`` (used only when ``beta > 0``) defaults to a frozen copy of the initial
        policy; ``reward_funcs`` (names, import paths or callables) default to ``args.reward_funcs``."""
        super().__init__(*trainer_args, **kwargs)
        if self.processing_class is None:
            raise ValueError("GRPOTrainer needs processing_class: the tokenizer that decodes completions")
        if self.eval_dataset is not None:
            raise ValueError(
                "GRPOTrainer does not evaluate during training; score checkpoints with trainers.evaluation.evaluate"
            )
        args = self.args
        grpo_generation(args).check(prompt_lengths(self.train_dataset), model_context(self.model))
        self.loss_fn = get_grpo_loss(args.loss_type)
        self.objective = get_policy_objective(args.policy_loss)
        self.log_ratio = IMPORTANCE_LEVELS.lookup(args.importance_sampling_level).log_ratio
        self.objective_params = args.objective_params
        self.reward_functions, weights = resolve_rewards(
            reward_funcs if reward_funcs is not None else args.reward_funcs, args.reward_weights
        )
        self.reward_weights = torch.tensor(weights, dtype=torch.float32)
        self.sharding = sharding_of(self.accelerator.state)  # of the policy's parameters, once prepared
        self.packing = packing_for(self.model, args.padding_free)
        self.ref_model = None  # with β > 0 and a LoRA policy, the anchor is the policy with its adapters disabled
        if args.beta > 0 and (ref_model is not None or not has_adapters(self.model)):
            reference = ref_model if ref_model is not None else copy.deepcopy(self.model)
            self.ref_model = prepare_reference(reference, self.accelerator)
        self.stop_ids = stop_token_ids(self.processing_class, self.model.generation_config)
        self.buffer = GenerationBuffer(args.num_iterations)
        self.generation_calls = 0
        self.backend = GENERATION_BACKENDS[args.generation_backend](self)
        # max_staleness ≥ 1: batches sampled ahead on the server (trainers/grpo/ahead.py)
        self.ahead = AheadSampler(cast(EngineBackend, self.backend), args.max_staleness) if args.max_staleness else None
        self.prompt_sampler: RepeatSampler | None = None  # the train dataloader's, once it is built
        self.window: dict[str, list[float]] = defaultdict(list)  # metrics since the last log
        self.window_started: float | None = None
        self.window_start_step = 0
        self.latest_samples: dict[str, list] = {}
        self.next_table_step = args.log_completions_steps

    # ---- resuming (trainers/runtime/checkpoints.py) --------------------------------------------------

    def checkpoint_state(self) -> dict:
        """What a resumed run needs beyond the ``Trainer``'s checkpoint: the generation buffer (a
        batch outlives the step it was sampled in), the metric window and the table schedule."""
        return {
            "buffer": self.buffer.state_dict(),
            "window": dict(self.window),
            "latest_samples": self.latest_samples,
            "next_table_step": self.next_table_step,
        }

    def load_checkpoint_state(self, state: dict) -> None:
        self.buffer.load_state_dict(state["buffer"])
        self.window = defaultdict(list, state["window"])
        self.latest_samples, self.next_table_step = state["latest_samples"], state["next_table_step"]

    # ---- data ------------------------------------------------------------------------------

    def get_train_dataloader(self) -> DataLoader:
        """Batches of per-device batch × ``steps_per_generation`` prompts from a :class:`RepeatSampler`
        (each prompt ``num_generations`` times, each generation batch repeated for every step and
        iteration that consumes it), sharded over processes by ``accelerator.prepare``."""
        if self.train_dataset is None:
            raise ValueError("GRPOTrainer: training requires a train_dataset of prompts")
        args = self.args
        loader = generation_dataloader(
            self.train_dataset,
            args.layout,
            num_iterations=args.num_iterations,
            seed=args.data_seed if args.data_seed is not None else args.seed,
            collate_fn=keep_rows,
            num_workers=args.dataloader_num_workers,
            pin_memory=args.dataloader_pin_memory,
        )
        self.prompt_sampler = cast(RepeatSampler, loader.sampler)  # the order upcoming() reads (its epoch is set)
        return self.accelerator.prepare(loader)

    # ---- generation buffer -----------------------------------------------------------------

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Swap the dataloader's batch (the prompts of the current generation batch, the same on
        every step of its cycle) for the next buffered slice, generating when the buffer is empty.

        ``training_step`` is the public override point that sees every micro-step; the private
        ``_prepare_inputs`` is left alone. Passing ``num_items_in_batch=None`` makes the Trainer
        divide each micro-step's loss by the accumulation steps, as the loss types expect.
        """
        if self.window_started is None:
            self.window_started, self.window_start_step = time.perf_counter(), self.state.global_step
        if self.buffer.is_empty:
            self.buffer.fill(self.generate_and_score(model, inputs))
        return super().training_step(model, self.buffer.next_slice(), None)

    @torch.no_grad()
    def generate(self, model, prompts: list[list[int]]) -> Rollouts:
        """Sampled completion tokens ``[N, ≤ max_completion_length]`` by the ``generation_backend``
        (:mod:`trainers.grpo.rollouts`)."""
        self.generation_calls += 1
        if self.ahead is None:
            return self.backend.sample(model, prompts)
        backend = cast(EngineBackend, self.backend)  # max_staleness needs a server (checked with the arguments)
        rollouts = self.ahead.take(prompts)
        if rollouts is None:  # not sampled ahead: the first round of an epoch, or of a resumed run
            rollouts = backend.sample(model, prompts)
        self.ahead.settle()
        backend.sync(model)
        self.ahead.ask(self.upcoming(prompts), lambda index: backend.completion_seeds(len(prompts), ahead=1 + index))
        return rollouts

    def upcoming(self, prompts: list[list[int]]) -> list[list[list[int]]]:
        """The prompts of the generation batches after the one of ``prompts`` in this epoch, as the
        dataloader will give them (the sampler's chunks, each prompt ``num_generations`` times): up to
        ``max_staleness`` of them; none where ``prompts`` is no batch of the epoch's order."""
        assert self.train_dataset is not None and self.prompt_sampler is not None  # training
        dataset, repeat, limit = self.train_dataset, self.args.num_generations, self.args.max_prompt_length

        def batch(chunk: list[int]) -> list[list[int]]:
            return [prompt_ids(dataset[index], limit) for index in chunk for _ in range(repeat)]

        chunks = self.prompt_sampler.chunks()
        for position, chunk in enumerate(chunks):  # a chunk's first prompt read, its whole batch only if that matches
            if prompt_ids(dataset[chunk[0]], limit) == prompts[0] and batch(chunk) == prompts:
                return [batch(later) for later in chunks[position + 1 : position + 1 + self.args.max_staleness]]
        return []

    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        finally:
            if self.ahead is not None:
                self.ahead.discard()  # the batches asked ahead are answered first: the engine is idle
            self.backend.close()

    def generate_and_score(self, model, rows: list[dict]) -> list[dict[str, torch.Tensor]]:
        args = self.args
        tokenizer = self.processing_class
        prompts = [prompt_ids(row, args.max_prompt_length) for row in rows]
        self.backend.start(model)  # outside time/generation
        started = time.perf_counter()
        rollouts = self.generate(model, prompts)
        self.window["time/generation"].append(time.perf_counter() - started)
        batch, completions, truncated = completion_batch(
            prompts, rollouts.tokens, self.stop_ids, tokenizer.pad_token_id, args.mask_truncated_completions
        )
        if rollouts.engine_logps is not None:
            batch["engine_logps"] = token_position_values(prompts, completions, rollouts.engine_logps)

        # the texts without the stop token (an end of turn may be plain text); the ids with it, as TRL's
        bare = [c[:-1] if not cut else c for c, cut in zip(completions, truncated)]
        texts = tokenizer.batch_decode(bare, skip_special_tokens=True)
        prompt_texts = tokenizer.batch_decode(prompts, skip_special_tokens=False)
        inputs = reward_kwargs(rows, prompt_texts, texts, completions, truncated, args.reward_inputs)
        per_function = torch.tensor(score_completions(self.reward_functions, inputs, self.state), dtype=torch.float32)
        per_function = self.gather(per_function.T.contiguous()).T  # [F, N over all processes]
        rewards = weighted_rewards(per_function, self.reward_weights)
        if rewards.isnan().all():  # nothing to learn from: every advantage 0, the loss 0 (same on every process)
            names = ", ".join(name for name, _ in self.reward_functions)
            raise RewardError(
                f"no reward function scored any of the {rewards.numel()} completions of the generation batch at "
                f"step {self.state.global_step}: {names} returned None or nan for each"
            )
        local = slice(self.accelerator.process_index * len(rows), (self.accelerator.process_index + 1) * len(rows))
        active = self.gather(batch["completion_mask"].sum().reshape(1)).sum().item()
        slices = self.split(
            batch, tokens_per_step=active / (args.layout.steps_per_generation * self.accelerator.num_processes)
        )
        self.add_sampling_logps(model, slices)
        scored = rewards
        if args.use_kl_in_reward:
            kl = self.reward_kl(slices)
            scored = rewards - args.beta * kl
            self.window["reward_kl"].append(kl.mean().item())
        advantages = group_advantages(scored, args.num_generations, args.scale_rewards, args.advantage_estimator)
        if args.normalize_advantages:
            advantages = normalized_advantages(advantages, ~rewards.isnan())
        for part, values in zip(slices, advantages[local].split(args.per_device_train_batch_size)):
            part["advantages"] = values
            # the version of the policy (its optimizer steps) that sampled the slice's completions
            part["policy_version"] = torch.full_like(values, rollouts.version, dtype=torch.long)
        self.record_generation(rewards, per_function, completions, truncated)
        self.latest_samples = self.sample_table(prompt_texts, texts, rewards[local], per_function[:, local])
        return slices

    def split(self, batch: dict[str, torch.Tensor], tokens_per_step: float) -> list[dict[str, torch.Tensor]]:
        """``steps_per_generation`` consecutive slices, each cut to its own longest row."""
        size = self.args.per_device_train_batch_size
        slices = []
        for start in range(0, len(batch["input_ids"]), size):
            part = {k: v[start : start + size] for k, v in batch.items()}
            width = int(part["attention_mask"].sum(-1).max())
            part = {k: v[:, :width] if v.dim() == 2 else v for k, v in part.items()}
            part["tokens_per_step"] = torch.tensor(tokens_per_step)
            slices.append(part)
        return slices

    @torch.no_grad()
    def add_sampling_logps(self, model, slices: list[dict[str, torch.Tensor]]) -> None:
        """``old_logps`` (the sampling policy) when the batch is reused off-policy or the KL is in the
        reward, and ``ref_logps`` when β > 0; computed once per generation batch."""
        if self.args.beta > 0:
            with live_reference(self.ref_model, self.model) as reference:
                self.add_token_logps(reference, slices, "ref_logps")
        if self.args.reuses_generations or self.args.use_kl_in_reward:
            with forward_model(model, self.accelerator, self.sharding) as policy:
                self.add_token_logps(policy, slices, "old_logps")

    def reward_kl(self, slices: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """Each completion's :func:`sequence_kl`, over every process in generation-batch order. The
        slices then drop what the loss must not read: ``ref_logps`` (the loss has no KL term) and, on
        an on-policy batch, ``old_logps``."""
        local = [sequence_kl(p["old_logps"], p["ref_logps"], p["completion_mask"][:, 1:]) for p in slices]
        for part in slices:
            del part["ref_logps"]
            if not self.args.reuses_generations:
                del part["old_logps"]
        return self.gather(torch.cat(local))

    def add_token_logps(self, source: torch.nn.Module, slices: list[dict[str, torch.Tensor]], name: str) -> None:
        """``slice[name]``: ``source``'s per-token log-probs of each slice's completions (in eval mode)."""
        was_training = source.training
        source.eval()
        device = self.accelerator.device
        packing = packing_for(source, self.args.padding_free)  # the policy's, or a reference's
        for part in slices:
            logps = next_token_logps(
                source,
                part["input_ids"].to(device),
                part["attention_mask"].to(device),
                part["completion_mask"].to(device),
                self.args.temperature,
                packing=packing,
            ).logps
            part[name] = logps.cpu()
        source.train(was_training)

    # ---- loss ------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Per token: the objective of the importance ratio, minus ``entropy_coef``·H (when
        non-zero), times the high-entropy mask (when ``top_entropy_quantile`` < 1), plus β·KL; then
        the ``loss_type`` aggregation. Only completion positions are projected and scored; the
        entropy comes from the same pass and is backpropagated only for the bonus."""
        args = self.args
        # One chunked pass over the completion positions gives the log-probs and the entropy (for the
        # metric, and for the options): no second full-vocabulary tensor, no prompt positions.
        logps, entropy = next_token_logps(
            model,
            inputs["input_ids"],
            inputs["attention_mask"],
            inputs["completion_mask"],
            args.temperature,
            entropy=True,
            packing=self.packing,
        )
        assert entropy is not None  # asked for
        mask = inputs["completion_mask"][:, 1:].to(logps.dtype)
        old_logps = inputs["old_logps"] if "old_logps" in inputs else logps.detach()
        advantages = inputs["advantages"]
        log_ratio = self.log_ratio(logps, old_logps, mask)
        per_token = self.objective(log_ratio, logps, advantages, self.objective_params)
        metrics: dict[str, torch.Tensor] = {}
        if "policy_version" in inputs:  # a slice of a checkpoint written before versions were recorded has none
            staleness = (self.state.global_step - inputs["policy_version"]).float()
            metrics |= {"staleness/steps_mean": staleness.mean(), "staleness/steps_max": staleness.max()}
        engine_logps = inputs["engine_logps"][:, 1:] if "engine_logps" in inputs else None
        if args.off_policy_mask_threshold is not None:
            sampler = old_logps if engine_logps is None else engine_logps  # what sampled the completions
            kept = off_policy_sequence_mask(advantages, logps, sampler, mask, args.off_policy_mask_threshold)
            per_token = per_token * kept
            metrics["off_policy/masked_fraction"] = 1.0 - kept.mean()
        if engine_logps is not None:
            # π_old as the trainer computes it (stored, or this pass on an on-policy batch) against the
            # engine's log-probs of the same tokens: how far the engine's sampler is from the policy
            gap = (old_logps - engine_logps).abs()[mask.bool()]
            if gap.numel():  # a slice of masked completions only has none
                metrics |= {"vllm/logp_diff_mean": gap.mean(), "vllm/logp_diff_max": gap.max()}
            if args.vllm_importance_sampling_cap is not None:
                correction = MISMATCH_CORRECTIONS.lookup(args.vllm_importance_sampling_mode)
                weighted = correction.weights(
                    old_logps,
                    engine_logps,
                    mask,
                    args.vllm_importance_sampling_cap,
                    args.vllm_importance_sampling_clip_min,
                )
                per_token = per_token * weighted.weights
                metrics |= weighted.metrics(mask)
        if args.entropy_coef:
            per_token = per_token - args.entropy_coef * entropy  # the one use of the entropy's gradient
        if args.top_entropy_quantile < 1.0:
            selected = high_entropy_mask(entropy.detach(), mask, args.top_entropy_quantile)
            per_token = per_token * selected
            metrics["entropy_mask/kept_fraction"] = masked_mean(selected, mask)
        if "ref_logps" in inputs:
            if args.use_bias_correction_kl:
                kl = bias_corrected_k3_kl(logps, old_logps, inputs["ref_logps"])
            else:
                kl = k3_kl(logps, inputs["ref_logps"])
            per_token = per_token + args.beta * kl
            metrics["kl"] = masked_mean(kl.detach(), mask)
        loss = self.loss_fn(
            per_token,
            mask,
            max_completion_length=args.max_completion_length,
            tokens_per_step=inputs["tokens_per_step"].item(),
        )

        with torch.no_grad():
            if self.objective.metrics is not None:
                metrics |= self.objective.metrics(torch.exp(log_ratio), advantages, mask, self.objective_params)
        metrics["entropy"] = masked_mean(entropy.detach(), mask)
        self.record_step(metrics)
        return (loss, {"logps": logps}) if return_outputs else loss

    # ---- metrics ---------------------------------------------------------------------------

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate a tensor over all processes (on the accelerator's device for the collective)."""
        return self.accelerator.gather(tensor.to(self.accelerator.device)).cpu()

    def record_step(self, metrics: dict[str, torch.Tensor]) -> None:
        """A micro-step's metrics, over the processes: the mean, or the max of a ``…_max`` metric and
        the min of a ``…_min`` one (which the logged window also takes, :func:`window_value`)."""
        names = list(metrics)
        gathered = self.gather(torch.stack([metrics[n].detach().float() for n in names]).unsqueeze(0))
        for name, column in zip(names, gathered.T.tolist()):
            self.window[name].append(window_value(name, column))

    def record_generation(
        self, rewards: torch.Tensor, per_function: torch.Tensor, completions: list[list[int]], truncated: list[bool]
    ) -> None:
        """Reward and completion statistics of one generation batch (all processes)."""
        grouped_std = nan_std(rewards.view(-1, self.args.num_generations), dim=1)
        lengths = self.gather(torch.tensor([len(c) for c in completions], dtype=torch.float32))
        clipped = self.gather(torch.tensor(truncated, dtype=torch.float32))
        values = {
            "reward": rewards.nanmean().item(),  # over the scored completions
            "reward_std": grouped_std.mean().item(),
            "frac_reward_zero_std": (grouped_std < 1e-6).float().mean().item(),
            "frac_reward_missing": rewards.isnan().float().mean().item(),
            "completions/mean_length": lengths.mean().item(),
            "completions/clipped_ratio": clipped.mean().item(),
        }
        for (name, _), scores in zip(self.reward_functions, per_function):
            present = scores[~scores.isnan()]
            values[f"rewards/{name}/mean"] = present.mean().item() if len(present) else math.nan
            values[f"rewards/{name}/std"] = present.std().item() if len(present) > 1 else math.nan
        for name, value in values.items():
            self.window[name].append(value)

    def sample_table(
        self, prompts: list[str], completions: list[str], rewards: torch.Tensor, per_function: torch.Tensor
    ) -> dict[str, list]:
        rows = slice(0, self.args.num_completions_to_log)
        table = {"prompt": prompts[rows], "completion": completions[rows], "reward": rewards[rows].tolist()}
        for (name, _), scores in zip(self.reward_functions, per_function):
            table[f"rewards/{name}"] = scores[rows].tolist()
        return table

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add the window's GRPO metrics, seconds per optimizer step (generating and the rest)
        and, every ``log_completions_steps``, a table of sample completions."""
        steps = self.state.global_step - self.window_start_step
        if self.window and steps > 0 and self.window_started is not None:
            generation_seconds = sum(self.window.pop("time/generation", []))
            logs.update({name: window_value(name, values) for name, values in self.window.items() if values})
            step_seconds = (time.perf_counter() - self.window_started) / steps
            logs["time/generation_per_step"] = generation_seconds / steps
            logs["time/training_per_step"] = step_seconds - generation_seconds / steps
            self.window.clear()
            self.window_started, self.window_start_step = time.perf_counter(), self.state.global_step
        steps_due = self.args.log_completions_steps
        if steps_due and self.latest_samples and self.state.global_step >= self.next_table_step:
            # a table among the floats Trainer.log declares: the pipeline's callback takes it out
            cast(dict[str, Any], logs)[COMPLETIONS_LOG_KEY] = {
                "step": [self.state.global_step] * len(self.latest_samples["prompt"]),
                **self.latest_samples,
            }
            self.next_table_step = (self.state.global_step // steps_due + 1) * steps_due
        super().log(logs, start_time)
