"""KTO's config section: its fields and checks. No torch here: the experiment config and
:class:`trainers.kto.trainer.KTOConfig` both take their KTO fields from this section."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from trainers.sections import SchedulerName, TrainingConfig


class KTOStageConfig(TrainingConfig):
    num_train_epochs: float = Field(3.0, gt=0, description="Epochs over the unpaired completions (two per pair).")
    per_device_train_batch_size: int = Field(16, ge=1, description="Completions per step (and as many KL completions).")
    lr_scheduler_type: SchedulerName = "constant"
    logging_steps: int = Field(20, ge=1)
    beta: float = Field(0.1, gt=0, description="β: scale of the implicit reward log π/ref − z₀ in the KTO value.")
    desirable_weight: float = Field(1.0, gt=0, description="λ_D: weight of the loss of desirable (chosen) completions.")
    undesirable_weight: float = Field(
        1.0, gt=0, description="λ_U: weight of the loss of undesirable (rejected) completions."
    )
    reference: Literal["cached", "live"] = Field(
        "cached",
        description="`cached`: reference log-probs of the completions and their KL completions, computed once into "
        "the reference cache; `live`: a frozen reference model in memory, a second forward per step.",
    )
