"""Token lengths from the data: ``max_length`` / ``max_prompt_length: auto``.

A fixed length suits one dataset: the built-in task's 32/16 cuts every ChatML prompt (a system
turn alone is longer). ``auto`` reads the lengths off the rendered rows instead: the prompt limit
is the smallest length that fits :data:`FIT_SHARE` of every split's prompts, the total limit the
smallest that fits that share of every split's (prompt as cut + longest completion), each rounded
up to a multiple of :data:`ROUND_TO`, and both capped by the model's context. Each cap cuts at most
0.5% of a split's rows, so the two together at most 1%.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

from trainers.data import RenderedRow, Truncation

AUTO = "auto"
FIT_SHARE = 0.995
ROUND_TO = 8

Length = int | Literal["auto"]


def fitting_length(lengths: Sequence[int], share: float = FIT_SHARE) -> int:
    """The smallest multiple of :data:`ROUND_TO` that is at least ``share`` of ``lengths`` (one
    nearest-rank quantile: no interpolation, so the result is a length some row has, rounded up)."""
    if not lengths:
        return 0
    rank = max(math.ceil(share * len(lengths)), 1)
    return math.ceil(sorted(lengths)[rank - 1] / ROUND_TO) * ROUND_TO


def resolve_truncation(
    splits: Mapping[str, Iterable[RenderedRow]],
    max_length: Length,
    max_prompt_length: Length,
    mode: Literal["keep_end", "keep_start", "drop"],
    context: int | None,
) -> Truncation:
    """The lengths to cut ``splits`` to: fixed values as given, ``auto`` ones from the rows (see
    the module), capped by ``context`` (the model's maximum positions, None: unknown). A fixed
    ``max_length`` caps an automatic prompt length at ``max_length - 1``; an automatic total is at
    least the prompt length + 1, so every completion keeps a token."""
    rows = {split: list(rendered) for split, rendered in splits.items()}
    ceiling = max_length if max_length != AUTO else context
    prompt = max_prompt_length
    if prompt == AUTO:
        prompt = max((fitting_length([len(r.prompt_ids) for r in split]) for split in rows.values()), default=1)
        prompt = max(min(prompt, ceiling - 1) if ceiling else prompt, 1)
    total = max_length
    if total == AUTO:
        total = max(
            (
                fitting_length([min(len(r.prompt_ids), prompt) + r.longest for r in split if r.completions])
                for split in rows.values()
            ),
            default=0,
        )
        total = max(min(total, context) if context else total, prompt + 1)
    return Truncation(total, prompt, mode)


def context_length(path: str, revision: str | None = None) -> int | None:
    """The model's maximum positions (``max_position_embeddings``, GPT-2's ``n_positions``), or None
    where the folder has no model config (a tokenizer alone) or the config names none."""
    from transformers import AutoConfig  # only when a length is automatic

    try:
        config = AutoConfig.from_pretrained(path, revision=revision)
    except (OSError, ValueError):
        return None
    return getattr(config, "max_position_embeddings", None)
