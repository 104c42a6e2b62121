"""The distillation stage's config section: its fields and defaults. No torch here: the experiment
config and :class:`trainers.distill.trainer.DistillConfig` both take their fields from this section."""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

from pydantic import Field

from trainers.generation.budget import Generation
from trainers.sections import Placement, SchedulerName, StageCompute, TrainingConfig, check_placement

if TYPE_CHECKING:
    from trainers.distill.trainer import DistillConfig


class DistillStageConfig(TrainingConfig):
    teacher_model: str | None = Field(
        None,
        description="The teacher: `builtin:<name>`, a local checkpoint folder, an MLflow model URI (`runs:/…`, "
        "`models:/…`) or a Hugging Face id. It must share the student's tokenizer; it is loaded frozen and never "
        "trained. Required when the stage runs.",
    )
    teacher_revision: str | None = Field(None, description="Hub revision of a teacher model id.")
    teacher_device: Placement = Field(
        "policy",
        description="Where the teacher runs: `policy`, on each training process's device; `cpu`; or `cuda:N`, a GPU "
        "of its own that training does not use (one process). Its logits come back to the student's device.",
    )
    num_train_epochs: float = Field(3.0, gt=0, description="Epochs over the `sft` split's prompts.")
    per_device_train_batch_size: int = Field(16, ge=1, description="Prompts per step.")
    learning_rate: float = Field(1e-3, gt=0)
    lr_scheduler_type: SchedulerName = "constant"
    logging_steps: int = Field(20, ge=1)
    lmbda: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="λ: the fraction of steps whose completions the student samples (on-policy); the other steps "
        "train on the `sft` split's completions (TRL's name). 0: supervised KD on the data; 1: fully on-policy.",
    )
    beta: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="β of the generalized Jensen–Shannon divergence between teacher and student token "
        "distributions: 0 is the forward KL(teacher ‖ student), 1 the reverse KL(student ‖ teacher).",
    )
    temperature: float = Field(
        0.9,
        gt=0,
        description="Temperature of the student's sampling and of both distributions in the divergence.",
    )
    max_new_tokens: int = Field(
        128,
        ge=1,
        description="Most tokens the student (or, with seq_kd, the teacher) samples per completion (stops earlier at "
        "its stop token).",
    )
    seq_kd: bool = Field(
        False,
        description="Sequence-level KD (Kim & Rush, 2016; TRL's GKD name): the steps that are not on-policy train on "
        "completions the teacher samples for the `sft` split's prompts instead of the split's own completions.",
    )


def distill_generation(options: Union[DistillStageConfig, "DistillConfig"]) -> Generation | None:
    """The completions a section or a ``DistillConfig`` samples: ``max_new_tokens`` after each
    prompt where any step is on-policy (``lmbda`` > 0) or the teacher samples (``seq_kd``); none
    otherwise (supervised KD on the data's completions)."""
    if options.lmbda > 0 or options.seq_kd:
        return Generation(new_tokens=options.max_new_tokens, setting="distill.max_new_tokens")
    return None


def check_distill(section: DistillStageConfig, compute: StageCompute) -> None:
    """The stage cannot run without a teacher (the field has a default so the form and other stages
    load); a teacher's GPU of its own serves one process."""
    check_placement("teacher_device", section.teacher_device, compute)
    if section.teacher_model is None:
        raise ValueError(
            "teacher_model: the stage distils from a teacher; give its model source (a checkpoint folder, "
            "`models:/<name>@<alias>`, `runs:/<id>/model` or a hub id)"
        )
