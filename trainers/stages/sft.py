"""SFT: supervised fine-tuning on prompt/completion demonstrations with the plain ``Trainer``,
the loss on completion tokens only."""

from __future__ import annotations

from trainers.sft_section import SFTConfig
from trainers.stages.registry import StageInputs, StageSpec, register_stage


def build_sft(section: SFTConfig, inputs: StageInputs):
    from transformers import Trainer, TrainingArguments

    from trainers.collators import CompletionOnlyCollator

    model, tokenizer = inputs.load_policy()
    eval_split = inputs.splits.get("sft_eval")
    return Trainer(
        model=model,
        # the collator reads prompt_ids / completion_ids, which the model's forward does not take
        args=section.training_arguments(
            TrainingArguments,
            evaluates=eval_split is not None,
            **inputs.runtime_arguments(model),
            remove_unused_columns=False,
        ),
        train_dataset=inputs.splits["sft"],
        eval_dataset=eval_split,
        data_collator=CompletionOnlyCollator(tokenizer.pad_token_id),
        processing_class=tokenizer,
        callbacks=inputs.callbacks,
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
