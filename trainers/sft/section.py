"""SFT's config section: its defaults over :class:`~trainers.sections.TrainingConfig`. No torch here."""

from __future__ import annotations

from pydantic import Field

from trainers.sections import SchedulerName, TrainingConfig


class SFTConfig(TrainingConfig):
    num_train_epochs: float = Field(50.0, gt=0, description="Epochs over the SFT demonstrations.")
    per_device_train_batch_size: int = Field(64, ge=1)
    learning_rate: float = Field(3e-3, gt=0)
    lr_scheduler_type: SchedulerName = "cosine"
    warmup_ratio: float = Field(0.05, ge=0.0, lt=1.0, description="Fraction of steps used for linear warm-up.")
    logging_steps: int = Field(50, ge=1)
    batch_tokens: int | None = Field(
        None,
        ge=2,
        description="Packing: each step's batch holds rows of at most this many tokens in all (every row once an "
        "epoch, best-fit decreasing), instead of per_device_train_batch_size rows. null: batches of rows.",
    )
