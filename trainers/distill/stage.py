"""On-policy distillation (GKD): the policy, the student, learns the teacher's next-token
distributions on the `sft` split's prompts, over its own samples (a fraction λ of the steps) or the
data's completions."""

from __future__ import annotations

from trainers.distill.section import DistillStageConfig, check_distill, distill_generation
from trainers.stages.spec import ModelSource, StageInputs, StageSpec, register_stage


def build_distill(section: DistillStageConfig, inputs: StageInputs):
    from trainers.distill.trainer import DistillConfig, DistillTrainer, PromptCompletionCollator
    from trainers.models.pretrained import check_same_vocabulary, load_causal_lm

    model, tokenizer = inputs.load_policy()
    if inputs.teacher is None:
        raise ValueError("distill: the stage's inputs carry no teacher model")
    teacher, teacher_tokenizer = load_causal_lm(inputs.teacher.path, inputs.teacher.revision, inputs.dtype)
    check_same_vocabulary(
        tokenizer,
        teacher_tokenizer,
        f"the teacher {inputs.teacher.path}",
        "distillation compares next-token distributions id by id; use a teacher of the student's family",
    )
    return DistillTrainer(
        teacher_model=teacher,
        data_collator=PromptCompletionCollator(tokenizer.pad_token_id),
        **inputs.trainer_arguments(section, DistillConfig, model, tokenizer, "sft", "sft_eval"),
    )


def teacher_of(section: DistillStageConfig) -> ModelSource | None:
    return None if section.teacher_model is None else ModelSource(section.teacher_model, section.teacher_revision)


DISTILL = register_stage(
    StageSpec(
        name="distill",
        section=DistillStageConfig,
        splits=("sft",),
        build=build_distill,
        check=check_distill,
        generation=distill_generation,
        teacher=teacher_of,
        curves=("loss", "logps/student"),
        description="On-policy distillation (GKD) from `distill.teacher_model`, frozen: the generalized JSD between "
        "teacher and student next-token distributions on the student's samples (a fraction λ of the steps) or the "
        "`sft` split's completions.",
    )
)
