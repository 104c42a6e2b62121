"""The reward-model stage's config section: its fields and defaults. No torch here: the experiment
config and :class:`trainers.reward.trainer.RewardConfig` both take their fields from this section."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from trainers.sections import SchedulerName, TrainingConfig

# Kept in step with trainers.scoring.reward_model.REWARD_HEADS (which imports torch; a test checks both agree).
RewardHeadName = Literal["classifier", "likelihood"]


class RewardStageConfig(TrainingConfig):
    head: RewardHeadName = Field(
        "classifier",
        description="What scores a sequence: `classifier`, a one-logit head on the last token's state "
        "(AutoModelForSequenceClassification, TRL's reward model); `likelihood`, the model's own mean log-prob "
        "of the completion's tokens (SimPO's reference-free implicit reward; the causal LM is trained).",
    )
    num_train_epochs: float = Field(3.0, gt=0, description="Epochs over the preference pairs.")
    per_device_train_batch_size: int = Field(16, ge=1, description="Pairs per step (two sequences each).")
    learning_rate: float = Field(1e-3, gt=0)
    lr_scheduler_type: SchedulerName = "cosine"
    warmup_ratio: float = Field(0.05, ge=0.0, lt=1.0, description="Fraction of steps used for linear warm-up.")
    logging_steps: int = Field(20, ge=1)
    center_rewards_coefficient: float | None = Field(
        None,
        ge=0,
        description="Weight of the centring term mean((r_c + r_r)²) that keeps rewards near zero (Eisenstein et "
        "al. 2023; TRL's name; 0.01 there). null: none.",
    )
