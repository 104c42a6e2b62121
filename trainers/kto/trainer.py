"""``KTOTrainer``: KTO on unpaired completions labelled desirable or undesirable, a
``transformers.Trainer`` whose ``compute_loss`` is :func:`kto_losses`.

Per step, one forward of the policy over the batch's completions and their *KL completions*: each
row's prompt with another row's completion (mismatched, as in the paper and TRL; fixed per row by
:mod:`trainers.kto.data`), whose mean log-ratio estimates the KL reference point z₀. The reference
log-probs of both are cached columns (``reference='cached'``, computed once by the reference pass)
or come from a frozen copy of the starting model in memory (``'live'``; for a LoRA policy, itself
with its adapters disabled).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, Trainer

from trainers.data.collators import two_completion_batch
from trainers.data.rows import LABEL
from trainers.kto.data import KL_COMPLETION, REF_KL_LOGPS, REF_LOGPS
from trainers.kto.section import KTOStageConfig
from trainers.models.attention import packing_for
from trainers.models.lora import has_adapters, live_reference
from trainers.runtime.arguments import PassArguments
from trainers.runtime.metric_window import MetricWindow
from trainers.runtime.parameter_sharding import prepare_reference
from trainers.scoring.logprobs import completion_logps
from trainers.sections import section_fields


def kl_reference_point(kl_logratios: torch.Tensor) -> torch.Tensor:
    """KTO's reference point (Ethayarajh et al., 2024, arXiv:2402.01306, eq. 7), estimated from
    mismatched pairs ``(x_i, y_{i+1})``, without gradient:

        z₀ = max(0, mean_i [log π(y_{i+1} | x_i) − log ref(y_{i+1} | x_i)])

    ``kl_logratios`` are the KL rows of every process's batch, gathered: the mean is over all of
    them and the clamp comes after it, so that several processes give what one process gives
    (clamping each process's mean first would raise z₀ whenever one of them is negative)."""
    return kl_logratios.detach().mean().clamp(min=0)


def kto_losses(
    logratios: torch.Tensor,
    desirable: torch.Tensor,
    reference_point: torch.Tensor,
    beta: float,
    desirable_weight: float,
    undesirable_weight: float,
) -> torch.Tensor:
    """KTO (Ethayarajh et al., 2024, arXiv:2402.01306, eq. 8): per completion, with the implicit
    reward ``r = log π(y|x) − log ref(y|x)`` and the reference point ``z₀``,

        desirable:    L = λ_D (1 − σ(β (r − z₀)))
        undesirable:  L = λ_U (1 − σ(β (z₀ − r)))

    ``desirable`` is a boolean per row; ``z₀`` a scalar (:func:`kl_reference_point`)."""
    value = torch.where(desirable, beta * (logratios - reference_point), beta * (reference_point - logratios))
    weight = torch.full_like(logratios, undesirable_weight).masked_fill(desirable, desirable_weight)
    return weight * (1 - F.sigmoid(value))


@dataclass
class UnpairedCollator:
    """``2B`` rows: the ``B`` completions after their prompts, then the ``B`` KL completions after
    the same prompts; ``desirable`` holds the first ``B`` rows' labels, and ``ref_logps`` the
    cached reference log-probs of all ``2B`` when the rows carry them."""

    pad_token_id: int

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        batch = two_completion_batch(features, ("completion_ids", KL_COMPLETION), self.pad_token_id)
        batch["desirable"] = torch.tensor([bool(f[LABEL]) for f in features])
        if REF_LOGPS in features[0]:
            cached = [f[REF_LOGPS] for f in features] + [f[REF_KL_LOGPS] for f in features]
            batch[REF_LOGPS] = torch.tensor(cached, dtype=torch.float32)
        return batch


@dataclass
@section_fields(KTOStageConfig)
class KTOConfig(PassArguments):
    """``PassArguments`` plus the KTO section's fields (``beta``, the two weights), with its defaults."""

    remove_unused_columns: bool = False  # the collator reads prompt_ids / completion_ids / label


class KTOTrainer(MetricWindow, Trainer):
    args: KTOConfig
    model: PreTrainedModel  # or a PeftModel around one, which forwards its attributes
    loss_is_scaled_for_ga = False  # compute_loss returns a per-micro-batch mean

    def __init__(self, *args, ref_model: PreTrainedModel | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if self.args.reference == "live" and ref_model is None and not has_adapters(self.model):
            raise ValueError(
                "reference='live' needs a ref_model (optional for a LoRA policy: itself with its adapters disabled)"
            )
        self.ref_model = None if ref_model is None else prepare_reference(ref_model, self.accelerator)
        self.packing = packing_for(self.model, self.args.padding_free)
        self.ref_packing = packing_for(self.model if ref_model is None else ref_model, self.args.padding_free)

    def reference_logps(self, model, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The reference log-probs of the batch's ``2B`` rows: the cached column (``reference='cached'``)
        or the live reference model's."""
        if self.args.reference == "cached":
            if REF_LOGPS not in inputs:
                raise ValueError(f"reference='cached' needs the columns {[REF_LOGPS, REF_KL_LOGPS]} in the dataset")
            return inputs[REF_LOGPS]
        with torch.no_grad(), live_reference(self.ref_model, model) as reference:
            return completion_logps(
                reference,
                inputs["input_ids"],
                inputs["attention_mask"],
                inputs["completion_mask"],
                packing=self.ref_packing,
            ).logps

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        rows = inputs["desirable"].shape[0]
        ids, mask, completion = inputs["input_ids"], inputs["attention_mask"], inputs["completion_mask"]
        policy = completion_logps(model, ids, mask, completion, packing=self.packing)
        logratios = policy.logps - self.reference_logps(model, inputs)
        # z₀ over every process's KL rows (the prepared loaders give each process as many): the
        # same reference point everywhere
        kl = kl_reference_point(self.accelerator.gather(logratios[rows:].detach()))
        args, desirable = self.args, inputs["desirable"]
        losses = kto_losses(logratios[:rows], desirable, kl, args.beta, args.desirable_weight, args.undesirable_weight)
        loss = losses.mean()
        rewards = args.beta * logratios[:rows].detach()
        metrics = {"kl": kl, "num_tokens": mask[:rows].sum().float()}
        for name, chosen in (("chosen", desirable), ("rejected", ~desirable)):
            # 0 for a batch without such rows (a window's mean then counts it: small effect, logged as is)
            count = chosen.sum().clamp(min=1)
            metrics[f"rewards/{name}"] = rewards[chosen].sum() / count
            metrics[f"logps/{name}"] = policy.logps[:rows].detach()[chosen].sum() / count
        self.record_metrics(metrics, "train" if model.training else "eval")
        return (loss, {"logratios": logratios[:rows]}) if return_outputs else loss
