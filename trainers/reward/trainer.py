"""``RewardTrainer``: a reward model (:data:`~trainers.scoring.reward_model.REWARD_HEADS`) trained on
preference pairs with the Bradley–Terry loss (:func:`trainers.reward.losses.bradley_terry_losses`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, Trainer

from trainers.data.collators import two_completion_batch
from trainers.models.attention import packing_for
from trainers.reward.losses import bradley_terry_losses
from trainers.reward.section import RewardStageConfig
from trainers.runtime.arguments import PassArguments
from trainers.runtime.metric_window import MetricWindow
from trainers.scoring.reward_model import REWARD_HEADS
from trainers.sections import section_fields


@dataclass
class PairSequenceCollator:
    """``2B`` sequences, the ``B`` prompt + chosen then the ``B`` prompt + rejected, padded right;
    ``margin`` when the pairs have one."""

    pad_token_id: int

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        batch = two_completion_batch(features, ("chosen_ids", "rejected_ids"), self.pad_token_id)
        if "margin" in features[0]:
            batch["margin"] = torch.tensor([float(f["margin"]) for f in features])
        return batch


@dataclass
@section_fields(RewardStageConfig)
class RewardConfig(PassArguments):
    """``PassArguments`` plus the reward section's fields, with its defaults."""

    remove_unused_columns: bool = False  # the collator reads prompt_ids / chosen_ids / rejected_ids


class RewardTrainer(MetricWindow, Trainer):
    """Trains a reward model (``args.head``) on preference pairs with :func:`bradley_terry_losses`;
    logs the pairs' ``accuracy`` (r_c > r_r), mean ``margin`` and rewards, ``eval_``-prefixed on the
    held-out pairs."""

    args: RewardConfig
    model: PreTrainedModel  # a sequence classifier or a causal LM (or a PeftModel around one)
    loss_is_scaled_for_ga = False  # compute_loss returns a per-micro-batch mean

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.head = REWARD_HEADS.lookup(self.args.head)
        self.packing = packing_for(self.model, self.args.padding_free)
        model_class = type(self.model).__name__
        if not self.head.matches([model_class]):
            raise ValueError(
                f"head {self.args.head!r} scores with a …{self.head.architecture_suffix} model, not a {model_class}: "
                "load it with load_reward_model(path, head=…)"
            )

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        rewards = self.head.score(model, inputs, self.packing)
        chosen, rejected = rewards.to(torch.promote_types(rewards.dtype, torch.float32)).chunk(2)
        losses = bradley_terry_losses(chosen, rejected, inputs.get("margin"), self.args.center_rewards_coefficient)
        loss = losses.mean()
        difference = (chosen - rejected).detach()
        metrics = {
            "accuracy": (difference > 0).float().mean(),
            "margin": difference.mean(),
            "rewards/chosen": chosen.detach().mean(),
            "rewards/rejected": rejected.detach().mean(),
        }
        self.record_metrics(metrics, "train" if model.training else "eval")
        return (loss, {"rewards": rewards}) if return_outputs else loss
