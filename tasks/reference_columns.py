"""Reference log-probs read from the cache onto the prepared splits, without Prefect: what a stage's
trainer reads (in a launched rank too) once the train task has made sure the entry is there and
sound (:func:`tasks.reference.ensure_entry`, which computes a missing or corrupt one)."""

from __future__ import annotations

import datasets
import numpy as np
import pyarrow as pa

from infra.core.handles import ReferenceLogps
from infra.core.refcache import CacheEntry, CacheIntegrityError, ReferenceCache
from infra.core.settings import get_settings
from trainers.catalog import REFERENCE_VIEWS
from trainers.data.rows import REF_COLUMNS
from trainers.scoring.reference_views import ReferenceView


def reference_store(root: str | None = None) -> ReferenceCache:
    settings = get_settings()
    return ReferenceCache(root or settings.reference_cache_root, lock_timeout=settings.reference_lock_timeout)


def join_columns(
    split: datasets.Dataset | list[dict], table: pa.Table, where: str, view: ReferenceView
) -> datasets.Dataset | list[dict]:
    """``split`` with the view's cached ``ref_*`` columns, matched on row id (position in the split).
    An entry stores a row's two log-probs as ``ref_chosen_logps`` / ``ref_rejected_logps``
    (``infra.core.refcache.SCHEMA``); they become ``view.columns``. Rows a view builds in memory
    (KTO's) stay a list: a ``datasets.Dataset`` built from them in a task would log the bytecode
    that ``datasets`` fingerprints."""
    row_ids = table.column("row_id").to_numpy()
    if not np.array_equal(np.sort(row_ids), np.arange(len(split))):
        raise CacheIntegrityError(f"{where}: row ids are not exactly the {len(split)} prepared rows")
    order = np.argsort(row_ids)
    columns = {
        column: table.column(stored).to_numpy()[order].tolist() for stored, column in zip(REF_COLUMNS, view.columns)
    }
    if isinstance(split, list):
        return [row | {column: values[index] for column, values in columns.items()} for index, row in enumerate(split)]
    for column, values in columns.items():
        split = split.add_column(column, values)
    return split


def joined_splits(ref: ReferenceLogps, entry: CacheEntry) -> dict[str, datasets.Dataset | list[dict]]:
    """The splits of ``ref``'s view with ``entry``'s columns joined on (:func:`join_columns`)."""
    view = REFERENCE_VIEWS.lookup(ref.view)
    scored = view.splits(datasets.load_from_disk(ref.data.path))
    return {
        split: join_columns(scored[split], table, f"{entry.uri} ({split})", view)
        for split, table in entry.tables.items()
    }


def read_reference_columns(ref: ReferenceLogps) -> dict[str, datasets.Dataset | list[dict]]:
    """:func:`joined_splits` of ``ref``'s verified entry, which must be there: a missing or corrupt
    one is a :class:`CacheIntegrityError` (nothing is computed here)."""
    expected = REFERENCE_VIEWS.lookup(ref.view).rows(ref.data.rows)
    return joined_splits(ref, reference_store(ref.root).read(ref.key, expected))
