"""Collators: right-padded batches with attention and completion masks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainers.data.rows import REF_COLUMNS

IGNORE_INDEX = -100


def pad_right(sequences: list[list[int]], pad_value: int) -> torch.Tensor:
    width = max(len(s) for s in sequences)
    return torch.tensor([s + [pad_value] * (width - len(s)) for s in sequences], dtype=torch.long)


def pad_left(sequences: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in sequences)
    ids = torch.tensor([[pad_token_id] * (width - len(s)) + s for s in sequences], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences], dtype=torch.long)
    return ids, mask


def sequence_batch(sequences: list[list[int]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """``input_ids`` padded right and their ``attention_mask``."""
    return {
        "input_ids": pad_right(sequences, pad_token_id),
        "attention_mask": pad_right([[1] * len(s) for s in sequences], 0),
    }


def prompt_completion_batch(prompts: list[list[int]], completions: list[list[int]], pad_token_id: int) -> dict:
    """``input_ids`` = prompt + completion, padded right; ``completion_mask`` marks completion tokens."""
    masks = [[0] * len(p) + [1] * len(c) for p, c in zip(prompts, completions)]
    batch = sequence_batch([p + c for p, c in zip(prompts, completions)], pad_token_id)
    return batch | {"completion_mask": pad_right(masks, 0)}


def two_completion_batch(rows: list[dict], completions: tuple[str, str], pad_token_id: int) -> dict:
    """``2B`` rows for one concatenated forward: each row's ``prompt_ids`` + its first completion
    column, then each row's ``prompt_ids`` + its second (a pair's chosen, then its rejected)."""
    prompts = [row["prompt_ids"] for row in rows]
    first, second = completions
    scored = [row[first] for row in rows] + [row[second] for row in rows]
    return prompt_completion_batch(prompts + prompts, scored, pad_token_id)


@dataclass
class CompletionOnlyCollator:
    """SFT batches whose ``labels`` hide prompt and padding (loss on completion tokens only)."""

    pad_token_id: int

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        batch = prompt_completion_batch(
            [f["prompt_ids"] for f in features], [f["completion_ids"] for f in features], self.pad_token_id
        )
        completion_mask = batch.pop("completion_mask")
        batch["labels"] = batch["input_ids"].masked_fill(completion_mask == 0, IGNORE_INDEX)
        return batch


@dataclass
class PreferenceCollator:
    """One batch of ``2B`` rows, chosen first then rejected, for a single concatenated forward.

    Cached reference log-probs, when the dataset carries them, travel as ``ref_*`` tensors.
    """

    pad_token_id: int

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        batch = two_completion_batch(features, ("chosen_ids", "rejected_ids"), self.pad_token_id)
        for column in REF_COLUMNS:
            if column in features[0]:
                batch[column] = torch.tensor([f[column] for f in features], dtype=torch.float32)
        return batch
