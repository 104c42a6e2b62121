"""SFT: supervised fine-tuning on prompt/completion demonstrations (:class:`~trainers.sft.trainer.SFTTrainer`),
the loss on completion tokens only."""

from __future__ import annotations

from trainers.sft.section import SFTConfig
from trainers.stages.spec import StageInputs, StageSpec, register_stage


def build_sft(section: SFTConfig, inputs: StageInputs):
    from trainers.data.collators import CompletionOnlyCollator
    from trainers.sft.trainer import SFTArguments, SFTTrainer

    model, tokenizer = inputs.load_policy()
    return SFTTrainer(
        data_collator=CompletionOnlyCollator(tokenizer.pad_token_id),
        **inputs.trainer_arguments(section, SFTArguments, model, tokenizer, "sft", "sft_eval"),
    )


# The SFT model is the DPO reference: caching it keeps the reference log-prob cache warm.
SFT = register_stage(
    StageSpec(
        name="sft",
        section=SFTConfig,
        splits=("sft",),
        build=build_sft,
        description="Supervised fine-tuning on the `sft` split (loss on completion tokens only).",
        cacheable=True,
    )
)
