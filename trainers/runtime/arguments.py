"""The ``TrainingArguments`` every alignflow trainer takes: transformers' own, plus what its passes
read from the compute section."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments

from trainers.sections import PaddingFree


@dataclass
class PassArguments(TrainingArguments):
    """``TrainingArguments`` plus ``padding_free`` (``compute.padding_free``): whether the passes over
    whole sequences pack their rows without padding (``auto``: where the model's attention supports it)."""

    padding_free: PaddingFree = field(
        default="auto", metadata={"help": "Padding-free batches: auto (where the attention supports it), true, false."}
    )
