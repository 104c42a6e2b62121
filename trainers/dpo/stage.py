"""DPO: preference optimisation on chosen/rejected pairs with the registered preference losses,
against cached reference log-probs (default), a live reference model, or none. A reference-free
objective (every chosen loss declares ``needs_reference=False``: simpo, cpo, orpo, sft) runs with
no reference at all: see :func:`trainers.dpo.section.reference_source`."""

from __future__ import annotations

from trainers.dpo.section import DPOStageConfig
from trainers.stages.spec import StageInputs, StageSpec, register_stage


def build_dpo(section: DPOStageConfig, inputs: StageInputs):
    from trainers.data.collators import PreferenceCollator
    from trainers.dpo.trainer import DPOConfig, DPOTrainer

    model, tokenizer = inputs.load_policy()
    ref_model = inputs.load_reference() if section.reference_source() == "live" else None
    return DPOTrainer(
        ref_model=ref_model,
        data_collator=PreferenceCollator(tokenizer.pad_token_id),
        **inputs.trainer_arguments(section, DPOConfig, model, tokenizer, "preference", "preference_eval"),
    )


DPO = register_stage(
    StageSpec(
        name="dpo",
        section=DPOStageConfig,
        splits=("preference",),
        build=build_dpo,
        description="Preference optimisation on the `preference` split; its reference is the model it starts from.",
        needs_reference_logps=lambda section: section.reference_source() == "cached",
        curves=("loss", "rewards/accuracies"),
    )
)
