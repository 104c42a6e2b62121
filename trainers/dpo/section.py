"""DPO's config section: its fields (the loss hyperparameters come from :mod:`trainers.dpo.losses`),
their checks, and where a step's reference log-probs come from. No torch here: the experiment
config and :class:`trainers.dpo.trainer.DPOConfig` both take their DPO fields from this section."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from trainers.dpo.losses import LossMix, LossName, PreferenceHyperparameters, resolve_losses
from trainers.sections import SchedulerName, TrainingConfig

ReferenceMode = Literal["cached", "live", "none"]


def reference_source(reference: ReferenceMode, objective: LossMix) -> ReferenceMode:
    """Where the reference log-probs of a step come from: ``reference``, or ``"none"`` when the
    objective reads no reference (then no cache is built and no reference forward runs; the
    default ``cached`` is simply unused). ``live`` with such an objective is an error: it would
    load a reference model nobody reads."""
    if objective.needs_reference:
        return reference
    if reference == "live":
        raise ValueError(
            f"reference: live loads a reference model that {list(objective.names)} never reads "
            "(a reference-free objective); use reference: none or cached"
        )
    return "none"


# The hyperparameter fields (beta, label_smoothing, …) come from the loss module, which declares them.
class DPOStageConfig(PreferenceHyperparameters, TrainingConfig):
    num_train_epochs: float = Field(3.0, gt=0, description="Epochs over the preference pairs.")
    lr_scheduler_type: SchedulerName = "constant"
    logging_steps: int = Field(20, ge=1)
    loss_type: LossName | list[LossName] = Field(
        "sigmoid",
        description="A registered preference loss (trainers/dpo/losses.py), or a list of them combined by "
        "loss_weights.",
    )
    loss_weights: list[float] | None = Field(None, description="One weight per loss in loss_type (default: all 1).")
    reference: ReferenceMode = Field(
        "cached",
        description="`cached`: precomputed reference log-prob columns; `live`: a frozen reference model in memory; "
        "`none`: reference-free (reference log-probs taken as 0).",
    )
    sync_ref_model: bool = Field(
        False,
        description="With `reference: live`, mix the policy into the reference every ref_model_sync_steps (TR-DPO).",
    )
    ref_model_mixup_alpha: float = Field(0.6, gt=0.0, le=1.0, description="α in ref ← α·θ + (1 − α)·ref.")
    ref_model_sync_steps: int = Field(512, ge=1, description="Optimizer steps between reference syncs.")
    use_weighting: bool = Field(
        False,
        description="WPO: weight each pair's loss by the policy's own (per-token normalised) probability of its "
        "two completions, computed without gradient; applies to any loss_type.",
    )
    ld_alpha: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="LD-DPO: the policy's log-probs of completion tokens beyond the shorter completion of the pair "
        "are scaled by ld_alpha (null = off; 1 = no change); applies to any loss_type.",
    )

    @model_validator(mode="after")
    def _check_losses_and_reference(self) -> DPOStageConfig:
        objective = self.objective()
        reference_source(self.reference, objective)
        if self.use_weighting and objective.batch_level:
            raise ValueError(
                f"use_weighting: WPO weights pair i's loss, and {list(objective.batch_level)} sort the batch (term i "
                "is the i-th quantile, not pair i): the loss would change with the order of the pairs; use them "
                "without weighting"
            )
        if self.sync_ref_model and self.reference != "live":
            raise ValueError(f"sync_ref_model needs reference: live (got reference: {self.reference})")
        return self

    def objective(self) -> LossMix:
        """The chosen losses, validated against the hyperparameters."""
        return resolve_losses(self.loss_type, self.loss_weights, self)

    def reference_source(self) -> ReferenceMode:
        """``reference``, or ``"none"`` for a reference-free objective (:func:`reference_source`)."""
        return reference_source(self.reference, self.objective())
