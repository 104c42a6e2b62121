"""Reference log-probs of rows with a prompt and two completions (preference pairs, KTO rows and
their KL completions: ``trainers.scoring.reference_views``), computed once with a frozen model."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from trainers.data.collators import two_completion_batch
from trainers.models.attention import packing_for
from trainers.runtime.work_split import batches_of, gather_shards, local_shard
from trainers.scoring.logprobs import completion_logps
from trainers.scoring.reference_views import ReferenceView
from trainers.sections import PaddingFree


@torch.no_grad()
def reference_logps(
    model: PreTrainedModel,
    pad_token_id: int,
    rows: list[dict],
    batch_size: int,
    progress: bool = True,
    on_batch: Callable[[int], None] | None = None,
    state: Any | None = None,
    completions: tuple[str, str] = ("chosen_ids", "rejected_ids"),
    padding_free: PaddingFree = "auto",
) -> tuple[list[float], list[float]]:
    """Summed log-probs of the two ``completions`` columns of every row after its ``prompt_ids``
    (eval mode, no grad): a pair's ``chosen`` and ``rejected`` by default.

    With ``state`` (accelerate's ``PartialState`` of a launch) each process scores its share of
    the batches and every process gets all rows back, in order, bit-identical to one process.
    ``on_batch(rows_done)`` is called after each batch (e.g. to report progress elsewhere).
    ``padding_free``: ``compute.padding_free`` (the values agree with the padded pass's to float rounding)."""
    model.eval()
    packing = packing_for(model, padding_free)

    _, mine = local_shard(batches_of(rows, batch_size), state)
    scored = []
    # disable=None: a bar on a terminal only; redirected output (logs, CI) gets no bar fragments
    for part in tqdm(mine, desc="reference log-probs", disable=None if progress else True, mininterval=5):
        batch = two_completion_batch(part, completions, pad_token_id)
        batch = {name: tensor.to(model.device) for name, tensor in batch.items()}
        ids, mask, completion = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
        logps = completion_logps(model, ids, mask, completion, packing=packing).logps
        half = len(logps) // 2
        scored.append((logps[:half].tolist(), logps[half:].tolist()))
        if on_batch is not None:
            on_batch(half)
    gathered = gather_shards(scored, state)
    return [v for first, _ in gathered for v in first], [v for _, second in gathered for v in second]


def score_view(
    model: PreTrainedModel,
    pad_token_id: int,
    view: ReferenceView,
    prepared: Mapping[str, Any],
    batch_size: int,
    progress: bool = True,
    on_batch: Callable[[int], None] | None = None,
    state: Any | None = None,
    padding_free: PaddingFree = "auto",
) -> dict[str, tuple[list[float], list[float]]]:
    """:func:`reference_logps` of every split of ``view`` over the ``prepared`` splits, by split."""
    return {
        split: reference_logps(
            model, pad_token_id, rows, batch_size, progress, on_batch, state, view.completions, padding_free
        )
        for split, rows in view.rows_to_score(prepared).items()
    }
