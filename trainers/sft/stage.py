"""SFT: supervised fine-tuning on prompt/completion demonstrations with the plain ``Trainer``,
the loss on completion tokens only."""

from __future__ import annotations

from trainers.sft.section import SFTConfig
from trainers.stages.spec import StageInputs, StageSpec, register_stage


def build_sft(section: SFTConfig, inputs: StageInputs):
    from transformers import Trainer

    from trainers.data.collators import CompletionOnlyCollator
    from trainers.models.attention import packing_for
    from trainers.runtime.arguments import PassArguments

    model, tokenizer = inputs.load_policy()
    # the collator reads prompt_ids / completion_ids, which the model's forward does not take
    arguments = inputs.trainer_arguments(
        section, PassArguments, model, tokenizer, "sft", "sft_eval", remove_unused_columns=False
    )
    collator = CompletionOnlyCollator(tokenizer.pad_token_id, packing_for(model, arguments["args"].padding_free))
    return Trainer(data_collator=collator, **arguments)


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
