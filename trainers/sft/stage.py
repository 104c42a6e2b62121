"""SFT: supervised fine-tuning on prompt/completion demonstrations with the plain ``Trainer``,
the loss on completion tokens only."""

from __future__ import annotations

from trainers.sft.section import SFTConfig
from trainers.stages.spec import StageInputs, StageSpec, register_stage


def build_sft(section: SFTConfig, inputs: StageInputs):
    from transformers import Trainer, TrainingArguments

    from trainers.data.collators import CompletionOnlyCollator

    model, tokenizer = inputs.load_policy()
    return Trainer(
        data_collator=CompletionOnlyCollator(tokenizer.pad_token_id),
        # the collator reads prompt_ids / completion_ids, which the model's forward does not take
        **inputs.trainer_arguments(
            section, TrainingArguments, model, tokenizer, "sft", "sft_eval", remove_unused_columns=False
        ),
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
