"""SFT: supervised fine-tuning on prompt/completion demonstrations with the plain ``Trainer``,
the loss on completion tokens only."""

from __future__ import annotations

from pydantic import Field

from trainers.sections import SchedulerName, TrainingConfig
from trainers.stages.registry import StageInputs, StageSpec, register_stage


class SFTConfig(TrainingConfig):
    num_train_epochs: float = Field(50.0, gt=0, description="Epochs over the SFT demonstrations.")
    per_device_train_batch_size: int = Field(64, ge=1)
    learning_rate: float = Field(3e-3, gt=0)
    lr_scheduler_type: SchedulerName = "cosine"
    warmup_ratio: float = Field(0.05, ge=0.0, lt=1.0, description="Fraction of steps used for linear warm-up.")
    logging_steps: int = Field(50, ge=1)


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
            **inputs.runtime_arguments(),
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
        split="sft",
        build=build_sft,
        description="Supervised fine-tuning on the `sft` split (loss on completion tokens only).",
        cacheable=True,
    )
)
