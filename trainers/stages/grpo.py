"""GRPO: group-relative policy optimisation on prompts, rewarded by the registered reward functions."""

from __future__ import annotations

from trainers.grpo_section import GRPOStageConfig, check_generation_layout
from trainers.stages.registry import StageInputs, StageSpec, register_stage


def build_grpo(section: GRPOStageConfig, inputs: StageInputs):
    from trainers.grpo import GRPOConfig, GRPOTrainer

    model, tokenizer = inputs.load_policy()
    # The KL anchor is the policy GRPO starts from (with LoRA: the policy, adapters disabled);
    # with β = 0 no reference is loaded at all.
    ref_model = inputs.load_reference() if section.beta > 0 else None
    return GRPOTrainer(
        model=model,
        ref_model=ref_model,
        args=section.training_arguments(GRPOConfig, **inputs.runtime_arguments()),
        train_dataset=inputs.splits["grpo_prompts"],
        processing_class=tokenizer,
        callbacks=inputs.callbacks,
    )


GRPO = register_stage(
    StageSpec(
        name="grpo",
        section=GRPOStageConfig,
        split="grpo_prompts",
        build=build_grpo,
        check=check_generation_layout,
        description="Group-relative policy optimisation on the `grpo_prompts` split, rewarded by `reward_funcs`.",
    )
)
