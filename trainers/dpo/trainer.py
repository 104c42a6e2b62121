"""``DPOTrainer``: a ``transformers.Trainer`` whose ``compute_loss`` is a preference loss.

Per step: one forward of the policy over the concatenated ``[chosen; rejected]`` batch, summed
completion log-probs, reference log-probs from a live frozen reference model (for a LoRA policy:
itself with its adapters disabled), cached columns
(default in the pipeline), or zeros (reference-free: ``reference='none'``, or an objective whose
losses all declare ``needs_reference=False``, which then runs no reference at all), then the
registered loss(es) chosen by ``loss_type``, weighted by ``loss_weights``.

Two options apply to any loss: ``ld_alpha`` (LD-DPO) scales the policy's log-probs of the tokens
beyond the pair's shorter completion; ``use_weighting`` (WPO) weights each pair's loss by
:func:`wpo_pair_weights`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, Trainer

from trainers.data.rows import REF_COLUMNS
from trainers.dpo.losses import (
    LossMix,
    LossParams,
    PairLogps,
    PreferenceHyperparameters,
    resolve_losses,
    reward_metrics,
)
from trainers.dpo.section import DPOStageConfig, reference_source
from trainers.models.attention import packing_for
from trainers.models.lora import has_adapters, live_reference
from trainers.runtime.arguments import PassArguments
from trainers.runtime.callbacks import SyncReferenceCallback
from trainers.runtime.metric_window import MetricWindow
from trainers.runtime.parameter_sharding import prepare_reference, sharding_of
from trainers.scoring.logprobs import CompletionLogps, completion_logps
from trainers.sections import section_fields


@dataclass
@section_fields(DPOStageConfig)
class DPOConfig(PassArguments):
    """``PassArguments`` plus the DPO section's fields (``beta``, ``loss_type``, ``reference``, …),
    with its defaults. Build it from a section: ``DPOStageConfig(...).training_arguments(DPOConfig, output_dir=…)``,
    which also runs the section's checks."""

    remove_unused_columns: bool = False  # the collator reads prompt/chosen/rejected ids and ref_* columns


class RunningMean:
    """Mean of every value added so far (bco_pair's reward shift δ)."""

    def __init__(self):
        self.total, self.count = 0.0, 0

    def add(self, value: float) -> float:
        self.total += value
        self.count += 1
        return self.total / self.count

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0

    def state_dict(self) -> dict:
        return {"total": self.total, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.total, self.count = state["total"], state["count"]


def ld_token_weights(completion_mask: torch.Tensor, alpha: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """LD-DPO (Liu et al., 2024, arXiv:2409.06411) token weights for ``[chosen; rejected]`` rows:
    1 for the first ``l_p = min(|y_c|, |y_r|)`` tokens of each completion (the "public" length of
    the pair), ``α`` for the tokens beyond it, so the policy's log-prob of a completion becomes

        log π̂(y) = Σ_{t ≤ l_p} log π(y_t | ·) + α Σ_{t > l_p} log π(y_t | ·)

    (shaped like ``completion_mask``, in ``dtype``; prompt and padding positions get 1 and are not scored)."""
    half = completion_mask.shape[0] // 2
    lengths = completion_mask.sum(1)
    public = torch.minimum(lengths[:half], lengths[half:]).repeat(2)
    position = completion_mask.cumsum(1)  # t: 1-based index of a completion token in its completion
    beyond = (position > public[:, None]) & completion_mask.bool()
    return torch.ones(beyond.shape, dtype=dtype, device=beyond.device).masked_fill(beyond, alpha)


def wpo_pair_weights(chosen_logweights: torch.Tensor, rejected_logweights: torch.Tensor) -> torch.Tensor:
    """WPO (Zhou et al., 2024, arXiv:2406.11827, eq. 2 with its per-token normalisation): the weight
    of a pair is the product of its completions' length-normalised probabilities under the policy,
    each token's probability divided by ``Σ_v p_v²`` (its expectation under the policy's own
    sampling), clamped at 1 so a weight only ever lowers a pair's loss:

        w(y) = exp( (1/|y|) Σ_t [log π(y_t | ·) − log Σ_v π(v | ·)²] ),    w = min(1, w(y_c) w(y_r))

    The inputs are ``CompletionLogps.wpo_logweights``, computed without gradient."""
    return torch.exp(chosen_logweights + rejected_logweights).clamp(max=1.0)


class DPOTrainer(MetricWindow, Trainer):
    args: DPOConfig
    objective: LossMix
    model: PreTrainedModel  # or a PeftModel around one, which forwards its attributes
    loss_is_scaled_for_ga = False  # compute_loss returns a per-micro-batch mean

    def __init__(self, *args, ref_model: PreTrainedModel | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        hyperparameters = {name: getattr(self.args, name) for name in PreferenceHyperparameters.model_fields}
        self.loss_params = LossParams(**hyperparameters)
        self.objective = resolve_losses(self.args.loss_type, self.args.loss_weights, self.loss_params)
        # "none" for a reference-free objective: no reference forward, no cached columns read
        self.reference_mode = reference_source(self.args.reference, self.objective)
        # With LoRA, the live reference is the policy with its adapters disabled: no ref_model.
        needs_ref_model = self.reference_mode == "live" and not has_adapters(self.model)
        if ref_model is not None and self.reference_mode != "live" or ref_model is None and needs_ref_model:
            raise ValueError(
                f"reference={self.args.reference!r}: pass a ref_model exactly when reference='live' "
                "(optional for a LoRA policy, whose reference is itself with its adapters disabled)"
            )
        if self.args.sync_ref_model and ref_model is None:
            raise ValueError("sync_ref_model needs a separate ref_model to mix the policy into (not with LoRA)")
        self.ref_model = None if ref_model is None else prepare_reference(ref_model, self.accelerator)
        self.packing = packing_for(self.model, self.args.padding_free)
        self.ref_packing = packing_for(self.model if ref_model is None else ref_model, self.args.padding_free)
        if self.args.sync_ref_model and self.ref_model is not None:
            sync = SyncReferenceCallback(
                self.ref_model,
                self.args.ref_model_mixup_alpha,
                self.args.ref_model_sync_steps,
                sharding_of(self.accelerator.state),
            )
            self.add_callback(sync)
        self.reward_mean = RunningMean()

    def checkpoint_state(self) -> dict:
        """What a resumed run needs beyond the ``Trainer``'s checkpoint (trainers/runtime/checkpoints.py):
        bco_pair's running mean δ, the metric windows and, with TR-DPO's sync, the reference weights."""
        state = super().checkpoint_state() | {"reward_mean": self.reward_mean.state_dict()}
        if self.args.sync_ref_model:
            state["ref_model"] = self.accelerator.unwrap_model(self.ref_model).state_dict()
        return state

    def load_checkpoint_state(self, state: dict) -> None:
        super().load_checkpoint_state(state)
        self.reward_mean.load_state_dict(state["reward_mean"])
        if self.args.sync_ref_model:
            self.accelerator.unwrap_model(self.ref_model).load_state_dict(state["ref_model"])

    def reference_logps(self, inputs: dict[str, torch.Tensor], batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The live reference model's (``reference='live'``), the cached ``ref_*`` columns
        (``'cached'``) or zeros (``'none'``, or a reference-free objective)."""
        if self.reference_mode == "none":
            zeros = torch.zeros(batch_size, device=inputs["input_ids"].device)
            return zeros, zeros
        if self.reference_mode == "live":
            with torch.no_grad(), live_reference(self.ref_model, self.model) as reference:
                ref = completion_logps(
                    reference,
                    inputs["input_ids"],
                    inputs["attention_mask"],
                    inputs["completion_mask"],
                    packing=self.ref_packing,
                ).logps
            return ref[:batch_size], ref[batch_size:]
        if not all(column in inputs for column in REF_COLUMNS):
            raise ValueError(f"reference='cached' needs the columns {list(REF_COLUMNS)} in the dataset")
        return inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]

    def reward_shift(self, pairs: PairLogps, training: bool) -> float:
        """δ of a stateful loss (bco_pair): running mean of the batch-mean implicit rewards, updated
        in training only."""
        if not self.objective.stateful:  # spare every other loss a gather and a device sync
            return 0.0
        if not training:
            return self.reward_mean.mean
        rewards = self.args.beta * torch.cat([pairs.chosen_logratios, pairs.rejected_logratios]).detach().mean()
        return self.reward_mean.add(self.accelerator.gather(rewards[None]).mean().item())

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        batch_size = inputs["input_ids"].shape[0] // 2
        token_weights = None
        if self.args.ld_alpha is not None:
            dtype = torch.promote_types(next(model.parameters()).dtype, torch.float32)  # that of the log-probs
            token_weights = ld_token_weights(inputs["completion_mask"], self.args.ld_alpha, dtype)
        policy = completion_logps(
            model,
            inputs["input_ids"],
            inputs["attention_mask"],
            inputs["completion_mask"],
            token_weights=token_weights,
            wpo_terms=self.args.use_weighting,
            packing=self.packing,
        )
        ref_chosen, ref_rejected = self.reference_logps(inputs, batch_size)
        pairs = PairLogps(
            chosen=policy.logps[:batch_size],
            rejected=policy.logps[batch_size:],
            ref_chosen=ref_chosen,
            ref_rejected=ref_rejected,
            chosen_lengths=policy.num_tokens[:batch_size],
            rejected_lengths=policy.num_tokens[batch_size:],
            chosen_unweighted=None if policy.unweighted_logps is None else policy.unweighted_logps[:batch_size],
        )
        params = self.loss_params
        if self.objective.stateful:
            params = params.model_copy(update={"reward_shift": self.reward_shift(pairs, model.training)})
        losses, components = self.objective(pairs, params)
        metrics = self.batch_metrics(pairs, policy, components, inputs["attention_mask"])
        if policy.wpo_logweights is not None:  # use_weighting
            weights = wpo_pair_weights(policy.wpo_logweights[:batch_size], policy.wpo_logweights[batch_size:])
            losses = losses * weights.to(losses.dtype)
            metrics["wpo/weights"] = weights.mean()
        loss = losses.mean()
        self.record_metrics(metrics, "train" if model.training else "eval")
        return (loss, {"chosen_logps": pairs.chosen, "rejected_logps": pairs.rejected}) if return_outputs else loss

    def batch_metrics(
        self,
        pairs: PairLogps,
        policy: CompletionLogps,
        components: dict[str, torch.Tensor],
        attention_mask: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        beta, half = self.args.beta, len(pairs.chosen)
        metrics = reward_metrics(beta * pairs.chosen_logratios.detach(), beta * pairs.rejected_logratios.detach())
        metrics["logps/chosen"] = pairs.chosen.detach().mean()
        metrics["logps/rejected"] = pairs.rejected.detach().mean()
        # Mean logit over the vocabulary and the completion tokens of the chosen (rejected) rows.
        metrics["logits/chosen"] = policy.logit_sums[:half].sum() / policy.num_tokens[:half].sum().clamp(min=1)
        metrics["logits/rejected"] = policy.logit_sums[half:].sum() / policy.num_tokens[half:].sum().clamp(min=1)
        metrics["num_tokens"] = attention_mask.sum().float()
        if len(components) > 1:
            metrics.update({f"loss/{name}": loss.detach().mean() for name, loss in components.items()})
        return metrics
