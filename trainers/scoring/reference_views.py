"""What a reference pass scores: a *view* of the prepared splits whose rows each hold a prompt and
two completions, and the two ``ref_*`` columns their reference log-probs become. One entry per
shape of data a stage reads reference log-probs of; a stage names its view
(``StageSpec.reference_view``), and the view's name is part of the cache key. No torch here.

- ``pairs``: the preference splits as prepared; chosen and rejected (DPO).
- ``held_out_pairs``: the ``preference_eval`` split alone, for the evaluation's implicit rewards
  of a stage whose own view is another (KTO).
- ``kto``: KTO's rows and their KL completions, registered by KTO (:data:`trainers.kto.data.KTO_VIEW`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

from trainers.data.rows import PAIR_SPLITS, REF_COLUMNS
from trainers.registry import Registry

if TYPE_CHECKING:
    import datasets


@dataclass(frozen=True)
class ReferenceView:
    name: str
    sources: tuple[str, ...]  # the prepared splits it reads (their token digests are part of the cache key)
    # the scored splits, by name, from the prepared splits (a DatasetDict or a dict of row lists)
    splits: Callable[[Mapping[str, Any]], Mapping[str, datasets.Dataset | list[dict]]]
    # their row counts from the prepared splits' row counts (checked against a cache entry's, unread)
    rows: Callable[[Mapping[str, int]], dict[str, int]]
    completions: tuple[str, str]  # the two completion columns of a row, scored after its ``prompt_ids``
    columns: tuple[str, str]  # the reference log-prob columns they become, in the same order

    def rows_to_score(self, prepared: Mapping[str, Any]) -> dict[str, list[dict]]:
        """The scored splits as lists of rows (a ``datasets.Dataset`` split read into one)."""
        return {
            name: rows if isinstance(rows, list) else rows.to_list() for name, rows in self.splits(prepared).items()
        }


REFERENCE_VIEWS: Registry[ReferenceView] = Registry("reference view", "reference_view")


def register_view(view: ReferenceView) -> ReferenceView:
    REFERENCE_VIEWS.add(view.name, view)
    return view


def pairs_view(name: str, splits: tuple[str, ...]) -> ReferenceView:
    """A view of preference ``splits`` as prepared: chosen and rejected."""
    return ReferenceView(
        name=name,
        sources=splits,
        splits=lambda prepared: {split: prepared[split] for split in splits if split in prepared},
        rows=lambda counts: {split: rows for split, rows in counts.items() if split in splits},
        completions=("chosen_ids", "rejected_ids"),
        columns=REF_COLUMNS,
    )


PAIRS_VIEW = register_view(pairs_view("pairs", PAIR_SPLITS))
HELD_OUT_PAIRS_VIEW = register_view(pairs_view("held_out_pairs", ("preference_eval",)))
