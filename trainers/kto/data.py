"""KTO's rows: completions labelled desirable or undesirable, each with its *KL completion*, another
row's completion after this row's prompt (a mismatched pair whose log-ratio estimates KTO's
reference point z₀). No torch here: the reference pass scores these rows too
(:data:`KTO_VIEW`), so the trainer and the cache see the same pairs.

The KL partners are fixed per split, not drawn per batch (TRL builds its KL dataset once, too):
that is what lets the reference log-probs of the KL completions be computed once and cached."""

from __future__ import annotations

import random
from typing import Any, Collection, Mapping, Sequence

from trainers.data.rows import LABEL, PAIR_SPLITS
from trainers.scoring.reference_views import ReferenceView, register_view

KTO_SPLIT, KTO_EVAL_SPLIT = "kto", "kto_eval"
KL_COMPLETION = "kl_completion_ids"
REF_LOGPS, REF_KL_LOGPS = "ref_logps", "ref_kl_logps"  # cached reference log-probs of the two
KL_PARTNER_SEED = 0


def unpaired(pairs) -> list[dict]:
    """Preference pairs as unpaired rows, as the ``unpaired`` split has them: ``(prompt, chosen,
    label true)`` and ``(prompt, rejected, label false)`` for each pair, in the pairs' order (TRL's
    ``unpair_preference_dataset``). A list, which the Trainer samples like a dataset: a
    ``datasets.Dataset`` built here would fingerprint its builder with dill, whose bytecode listing
    a Prefect task logs."""
    rows = []
    for pair in pairs:
        rows.append({"prompt_ids": pair["prompt_ids"], "completion_ids": pair["chosen_ids"], LABEL: True})
        rows.append({"prompt_ids": pair["prompt_ids"], "completion_ids": pair["rejected_ids"], LABEL: False})
    return rows


def kl_partners(count: int, split: str, seed: int = KL_PARTNER_SEED) -> list[int]:
    """For each of ``count`` rows, the row whose completion is its KL completion: the successor in
    one random cycle through all rows, so no row is its own partner and every completion serves
    exactly once. (A fixed shift would pair the two halves of an unpaired preference pair, which
    share their prompt.)"""
    if count < 2:
        raise ValueError(
            f"split {split!r}: KTO's KL estimate pairs each prompt with another row's completion; "
            f"it needs at least 2 rows, got {count}"
        )
    cycle = list(range(count))
    random.Random(seed).shuffle(cycle)
    partners = [0] * count
    for position, row in enumerate(cycle):
        partners[row] = cycle[(position + 1) % count]
    return partners


def with_kl_completions(rows: Sequence[Mapping[str, Any]], split: str = KTO_SPLIT) -> list[dict]:
    """``rows`` (``prompt_ids``, ``completion_ids``, ``label``) of ``split``, each with its KL completion."""
    rows = list(rows)
    return [
        {"prompt_ids": row["prompt_ids"], "completion_ids": row["completion_ids"], LABEL: bool(row[LABEL])}
        | {KL_COMPLETION: rows[partner]["completion_ids"]}
        for row, partner in zip(rows, kl_partners(len(rows), split))
    ]


def kto_sources(prepared_splits: Collection[str]) -> dict[str, tuple[str, bool]]:
    """For each of KTO's splits, the prepared split it comes from and whether that split holds pairs
    (unpaired into two rows each): ``kto`` from the ``unpaired`` split, or else from the
    ``preference`` split's pairs; ``kto_eval`` from the ``preference_eval`` pairs, when prepared."""
    sources = {KTO_SPLIT: ("unpaired", False) if "unpaired" in prepared_splits else ("preference", True)}
    if "preference_eval" in prepared_splits:
        sources[KTO_EVAL_SPLIT] = ("preference_eval", True)
    return sources


def kto_splits(prepared: Mapping[str, Any]) -> dict[str, list[dict]]:
    """KTO's rows by split (:func:`kto_sources`), each row with its KL completion (:func:`with_kl_completions`)."""
    return {
        split: with_kl_completions(unpaired(prepared[source]), f"{source} (unpaired)")
        if pairs
        else with_kl_completions(prepared[source], source)
        for split, (source, pairs) in kto_sources(prepared).items()
    }


def kto_split_rows(prepared_rows: Mapping[str, int]) -> dict[str, int]:
    """The row counts of :func:`kto_splits` from the prepared splits' row counts."""
    return {
        split: prepared_rows[source] * (2 if pairs else 1)
        for split, (source, pairs) in kto_sources(prepared_rows).items()
    }


# What the reference pass scores of a KTO stage: the completion and its KL completion.
KTO_VIEW = register_view(
    ReferenceView(
        name="kto",
        sources=("unpaired", *PAIR_SPLITS),
        splits=kto_splits,
        rows=kto_split_rows,
        completions=("completion_ids", KL_COMPLETION),
        columns=(REF_LOGPS, REF_KL_LOGPS),
    )
)
