"""Reference log-probs of preference pairs, computed once with a frozen model."""

from __future__ import annotations

from typing import Callable

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from trainers.collators import PreferenceCollator
from trainers.logprobs import completion_logps


@torch.no_grad()
def reference_logps(
    model: PreTrainedModel,
    pad_token_id: int,
    rows: list[dict],
    batch_size: int,
    progress: bool = True,
    on_batch: Callable[[int], None] | None = None,
) -> tuple[list[float], list[float]]:
    """Summed completion log-probs of ``chosen`` and ``rejected`` for every row (eval mode, no grad).

    ``on_batch(rows_done)`` is called after each batch (e.g. to report progress elsewhere)."""
    model.eval()
    collate = PreferenceCollator(pad_token_id)
    chosen, rejected = [], []
    starts = range(0, len(rows), batch_size)
    # disable=None: a bar on a terminal only; redirected output (logs, CI) gets no bar fragments
    for start in tqdm(starts, desc="reference log-probs", disable=None if progress else True, mininterval=5):
        batch = collate(rows[start : start + batch_size])
        batch = {name: tensor.to(model.device) for name, tensor in batch.items()}
        logps = completion_logps(model, batch["input_ids"], batch["attention_mask"], batch["completion_mask"]).logps
        half = len(logps) // 2
        chosen += logps[:half].tolist()
        rejected += logps[half:].tolist()
        if on_batch is not None:
            on_batch(half)
    return chosen, rejected
