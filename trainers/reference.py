"""Reference log-probs of preference pairs, computed once with a frozen model."""

from __future__ import annotations

from typing import Any, Callable

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from trainers.collators import PreferenceCollator
from trainers.logprobs import completion_logps
from trainers.sharding import batches_of, gather_shards, local_shard


@torch.no_grad()
def reference_logps(
    model: PreTrainedModel,
    pad_token_id: int,
    rows: list[dict],
    batch_size: int,
    progress: bool = True,
    on_batch: Callable[[int], None] | None = None,
    state: Any | None = None,
) -> tuple[list[float], list[float]]:
    """Summed completion log-probs of ``chosen`` and ``rejected`` for every row (eval mode, no grad).

    With ``state`` (accelerate's ``PartialState`` of a launch) each process scores its share of
    the batches and every process gets all rows back, in order, bit-identical to one process.
    ``on_batch(rows_done)`` is called after each batch (e.g. to report progress elsewhere)."""
    model.eval()
    collate = PreferenceCollator(pad_token_id)
    _, mine = local_shard(batches_of(rows, batch_size), state)
    scored = []
    # disable=None: a bar on a terminal only; redirected output (logs, CI) gets no bar fragments
    for part in tqdm(mine, desc="reference log-probs", disable=None if progress else True, mininterval=5):
        batch = {name: tensor.to(model.device) for name, tensor in collate(part).items()}
        logps = completion_logps(model, batch["input_ids"], batch["attention_mask"], batch["completion_mask"]).logps
        half = len(logps) // 2
        scored.append((logps[:half].tolist(), logps[half:].tolist()))
        if on_batch is not None:
            on_batch(half)
    gathered = gather_shards(scored, state)
    return [v for chosen, _ in gathered for v in chosen], [v for _, rejected in gathered for v in rejected]
