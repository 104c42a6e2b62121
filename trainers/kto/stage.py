"""KTO: Kahneman–Tversky optimisation on completions labelled desirable or undesirable: the
`unpaired` split (TRL's unpaired format), or else the `preference` split's pairs, unpaired (chosen:
desirable, rejected: undesirable), against the model it starts from: cached reference log-probs of
KTO's rows (the reference view ``kto``: completions and KL completions), or a live frozen copy."""

from __future__ import annotations

from trainers.kto.data import KTO_VIEW
from trainers.kto.section import KTOStageConfig
from trainers.stages.spec import StageInputs, StageSpec, register_stage


def build_kto(section: KTOStageConfig, inputs: StageInputs):
    from trainers.kto.data import KTO_EVAL_SPLIT, KTO_SPLIT, kto_splits
    from trainers.kto.trainer import KTOConfig, KTOTrainer, UnpairedCollator

    model, tokenizer = inputs.load_policy()
    cached = section.reference == "cached"
    # cached: the reference pass's `kto` view of the data, with its ref columns; live: the same rows
    splits = inputs.splits if cached else kto_splits(inputs.splits)
    return KTOTrainer(
        ref_model=None if cached else inputs.load_reference(),
        data_collator=UnpairedCollator(tokenizer.pad_token_id),
        **inputs.trainer_arguments(section, KTOConfig, model, tokenizer, KTO_SPLIT, KTO_EVAL_SPLIT, splits),
    )


KTO = register_stage(
    StageSpec(
        name="kto",
        section=KTOStageConfig,
        splits=("unpaired", "preference"),
        build=build_kto,
        description="KTO on the `unpaired` split's labelled completions, or else on the `preference` split's pairs, "
        "unpaired (chosen: desirable, rejected: undesirable); its reference is the model it starts from.",
        needs_reference_logps=lambda section: section.reference == "cached",
        reference_view=KTO_VIEW.name,
        curves=("loss", "rewards/chosen"),
    )
)
