"""``DistillTrainer``: on-policy distillation from a frozen teacher (generalized knowledge
distillation, GKD: Agarwal et al., 2024, arXiv:2306.13649), a ``transformers.Trainer`` whose
``compute_loss`` is :func:`generalized_jsd` between the teacher's and the student's next-token
distributions over the completion's tokens.

Each micro-batch draws whether it is *on-policy* (probability λ, ``lmbda``): the student then
samples completions for the batch's prompts (at ``temperature``, cut at its first stop token) and
trains on those; otherwise it trains on the data's completions (supervised KD), or, with
``seq_kd``, on completions the teacher samples (sequence-level KD: Kim & Rush, 2016,
arXiv:1606.07947). The draw and the sampling are seeded by the step, so every process draws the
same and a resumed run repeats an uninterrupted one. The teacher must share the student's
tokenizer; it runs frozen on the student's device and is never trained.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase, Trainer

from trainers.data.collators import pad_left, prompt_completion_batch
from trainers.data.lengths import model_context, prompt_lengths
from trainers.distill.section import DistillStageConfig, distill_generation
from trainers.generation.token_sampling import sampled_generation_config, sampling_processors
from trainers.models.attention import packing_for
from trainers.models.devices import placed_on
from trainers.models.stop_tokens import cut_at_first_stop, stop_token_ids
from trainers.runtime.arguments import PassArguments
from trainers.runtime.metric_window import MetricWindow
from trainers.runtime.parameter_sharding import prepare_reference, sampling_model, sharding_of
from trainers.scoring.logprobs import forward_scored_positions
from trainers.sections import section_fields

if TYPE_CHECKING:
    from transformers import GenerationMixin


def generalized_jsd(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float, temperature: float = 1.0
) -> torch.Tensor:
    """The generalized Jensen–Shannon divergence of GKD (Agarwal et al., 2024, arXiv:2306.13649,
    eq. 2), per position: with ``S = softmax(z_S / τ)``, ``T = softmax(z_T / τ)`` over the
    vocabulary and the mixture ``M = β T + (1 − β) S``,

        JSD_β(T ‖ S) = β KL(T ‖ M) + (1 − β) KL(S ‖ M)            for 0 < β < 1,
        β = 0:  KL(T ‖ S)  (forward KL: supervised KD),   β = 1:  KL(S ‖ T)  (reverse KL),

    the endpoints taken unscaled (JSD_β itself vanishes there), as TRL's ``generalized_jsd_loss``
    does. Logits ``[N, V]``; the teacher's carry no gradient. Computed in float32 at least."""
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    student = F.log_softmax(student_logits.to(dtype) / temperature, dim=-1)
    teacher = F.log_softmax(teacher_logits.detach().to(dtype) / temperature, dim=-1)
    if beta == 0:
        return kl(teacher, student)
    if beta == 1:
        return kl(student, teacher)
    weights = torch.tensor([1 - beta, beta], dtype=dtype, device=student.device).log()
    mixture = torch.logsumexp(torch.stack([student + weights[0], teacher + weights[1]]), dim=0)
    return beta * kl(teacher, mixture) + (1 - beta) * kl(student, mixture)


def kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """KL(P ‖ Q) = Σ_v P_v (log P_v − log Q_v) over the last dimension, from log-probabilities."""
    return (p.exp() * (p - q)).sum(-1)


def derived_seed(*parts: object) -> int:
    """A 63-bit seed that is a function of ``parts`` only (the same on every process and run)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") >> 1


def draws_on_policy(seed: int, step: int, micro_step: int, lmbda: float) -> bool:
    """Whether micro-batch ``micro_step`` of optimizer step ``step`` trains on the student's own
    samples: true with probability λ, decided by the seed and the step alone."""
    return derived_seed(seed, "on-policy", step, micro_step) / 2**63 < lmbda


@dataclass
class PromptCompletionCollator:
    """The prompt and its data completion as one right-padded row (``completion_mask`` on the
    completion), and the prompts alone, left-padded, for the student to sample from."""

    pad_token_id: int

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        prompts = [f["prompt_ids"] for f in features]
        batch = prompt_completion_batch(prompts, [f["completion_ids"] for f in features], self.pad_token_id)
        batch["prompt_ids"], batch["prompt_mask"] = pad_left(prompts, self.pad_token_id)
        return batch


@dataclass
@section_fields(DistillStageConfig)
class DistillConfig(PassArguments):
    """``PassArguments`` plus the distillation section's fields (λ, β, temperature, …)."""

    remove_unused_columns: bool = False  # the collator reads prompt_ids / completion_ids


class DistillTrainer(MetricWindow, Trainer):
    args: DistillConfig
    model: PreTrainedModel  # or a PeftModel around one, which forwards its attributes
    processing_class: PreTrainedTokenizerBase  # checked in __init__

    loss_is_scaled_for_ga = False  # compute_loss returns a per-micro-batch mean

    def __init__(self, *trainer_args, teacher_model: PreTrainedModel, **kwargs):
        super().__init__(*trainer_args, **kwargs)
        if self.processing_class is None:
            raise ValueError("DistillTrainer needs processing_class: the tokenizer the student samples with")
        args = self.args
        tokenizer = self.processing_class
        if (generation := distill_generation(args)) is not None:  # sampled completions fit the student's context
            generation.check(prompt_lengths(self.train_dataset), model_context(self.model))
        self.teacher_device = placed_on(args.teacher_device, self.accelerator.device, "distill.teacher_device")
        self.packing = packing_for(self.model, args.padding_free)
        self.teacher_packing = packing_for(teacher_model, args.padding_free)
        if args.teacher_device == "policy":
            self.teacher = prepare_reference(teacher_model, self.accelerator)
        else:  # a device of its own: frozen there, outside accelerate (no mixed precision, no sharding)
            self.teacher = teacher_model.requires_grad_(False).eval().to(self.teacher_device)
        self.sharding = sharding_of(self.accelerator.state)
        self.stop_ids = stop_token_ids(tokenizer, self.model.generation_config)
        # the tokenizer's ids only: a teacher's padded embedding rows would be ids the student may not have
        self.sampling = sampling_processors(args.temperature, vocabulary=len(tokenizer))
        self.generation_config = sampled_generation_config(args.max_new_tokens, tokenizer.pad_token_id, self.stop_ids)
        self.micro_step = (-1, 0)  # (optimizer step, micro-batches seen in it)

    def training_step(self, model, inputs, num_items_in_batch=None):
        step = self.state.global_step
        micro = self.micro_step[1] + 1 if self.micro_step[0] == step else 0
        self.micro_step = (step, micro)
        on_policy = draws_on_policy(self.args.seed, step, micro, self.args.lmbda)
        if on_policy:
            inputs = self.sampled_batch(model, inputs, derived_seed(self.args.seed, "sample", step, micro))
        elif self.args.seq_kd:
            inputs = self.teacher_batch(inputs, derived_seed(self.args.seed, "teacher", step, micro))
        completions = inputs["completion_mask"].sum(1).float()
        self.record_metrics(
            {"on_policy": torch.tensor(float(on_policy)), "completion_length": completions.mean()}, "train"
        )
        return super().training_step(model, inputs, num_items_in_batch)

    @torch.no_grad()
    def sampled_batch(self, model, inputs: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
        """The batch's prompts with completions the student samples under ``seed`` (this process's
        rows get a seed of their own) instead of the data's."""
        with sampling_model(model, self.accelerator, self.sharding) as student:
            return self.completed_batch(student, inputs, seed, synced_gpus=self.sharding.lockstep)

    @torch.no_grad()
    def teacher_batch(self, inputs: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
        """The batch's prompts with completions the teacher samples under ``seed`` (``seq_kd``). The
        teacher is whole on every process (never sharded), so no process waits for another."""
        return self.completed_batch(self.teacher, inputs, seed, synced_gpus=False, on=self.teacher_device)

    def completed_batch(
        self,
        generator: PreTrainedModel,
        inputs: dict[str, torch.Tensor],
        seed: int,
        synced_gpus: bool,
        on: torch.device | None = None,
    ) -> dict[str, torch.Tensor]:
        """``generator``'s samples after the batch's prompts (generated ``on`` its device when it is not
        the trainer's), at the stage's temperature, cut at its first stop token; the batch on the trainer's device."""
        device, on = self.accelerator.device, on or self.accelerator.device
        with torch.random.fork_rng(devices=[on] if on.type == "cuda" else []):
            torch.manual_seed(derived_seed(seed, self.accelerator.process_index))
            output = cast("GenerationMixin", generator).generate(  # a causal LM (or a PeftModel around one)
                input_ids=inputs["prompt_ids"].to(on),
                attention_mask=inputs["prompt_mask"].to(on),
                generation_config=self.generation_config,
                logits_processor=self.sampling,
                synced_gpus=synced_gpus,
            )
        width = inputs["prompt_ids"].shape[1]
        completions, _ = cut_at_first_stop(output[:, width:].cpu(), self.stop_ids)
        prompts = [
            row[mask.bool()].tolist() for row, mask in zip(inputs["prompt_ids"].cpu(), inputs["prompt_mask"].cpu())
        ]
        batch = prompt_completion_batch(prompts, completions, self.processing_class.pad_token_id)
        return {name: tensor.to(device) for name, tensor in batch.items()}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        ids, mask, completion = inputs["input_ids"], inputs["attention_mask"], inputs["completion_mask"]
        # the logits of the positions that predict a completion token, in the same order for both models
        scored = forward_scored_positions(model, ids, mask, completion, self.packing, needs_logits=True)
        student = scored.scored_logits()
        with torch.no_grad():
            on = self.teacher_device
            teacher = forward_scored_positions(
                self.teacher, ids.to(on), mask.to(on), completion.to(on), self.teacher_packing, needs_logits=True
            ).scored_logits()
            teacher = teacher.to(student.device)
        width = min(student.shape[-1], teacher.shape[-1], len(self.processing_class))
        student, teacher = student[..., :width], teacher[..., :width]  # padded embedding rows name no token
        losses = generalized_jsd(student, teacher, self.args.beta, self.args.temperature)
        loss = losses.mean()
        targets = scored.targets
        metrics = {
            f"logps/{name}": F.log_softmax(logits.detach().float(), -1).gather(-1, targets[:, None]).mean()
            for name, logits in (("student", student), ("teacher", teacher))
        }
        metrics["num_tokens"] = scored.scored.sum().float()
        self.record_metrics(metrics, "train" if model.training else "eval")
        return (loss, {"losses": losses}) if return_outputs else loss
