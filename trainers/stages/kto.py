"""KTO: Kahneman–Tversky optimisation on completions labelled desirable or undesirable: the
`unpaired` split (TRL's unpaired format), or else the `preference` split's pairs, unpaired (chosen:
desirable, rejected: undesirable), against a live frozen copy of the model it starts from."""

from __future__ import annotations

from trainers.kto_section import KTOStageConfig
from trainers.stages.registry import StageInputs, StageSpec, register_stage


def build_kto(section: KTOStageConfig, inputs: StageInputs):
    from trainers.kto import KTOConfig, KTOTrainer, UnpairedCollator, unpaired

    model, tokenizer = inputs.load_policy()
    eval_split = inputs.splits.get("preference_eval")
    return KTOTrainer(
        model=model,
        ref_model=inputs.load_reference(),
        args=section.training_arguments(KTOConfig, evaluates=eval_split is not None, **inputs.runtime_arguments(model)),
        train_dataset=inputs.splits["unpaired"]
        if "unpaired" in inputs.splits
        else unpaired(inputs.splits["preference"]),
        eval_dataset=None if eval_split is None else unpaired(eval_split),
        data_collator=UnpairedCollator(tokenizer.pad_token_id),
        processing_class=tokenizer,
        callbacks=inputs.callbacks,
    )


KTO = register_stage(
    StageSpec(
        name="kto",
        section=KTOStageConfig,
        splits=("unpaired", "preference"),
        build=build_kto,
        description="KTO on the `unpaired` split's labelled completions, or else on the `preference` split's pairs, "
        "unpaired (chosen: desirable, rejected: undesirable); its reference is the model it starts from, live.",
    )
)
