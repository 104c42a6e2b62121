"""Content fingerprints (sha256) of files, folders and JSON-able values."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import datasets
import pyarrow.compute as pc

DIGEST_CHARS = 20


def hash_value(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:DIGEST_CHARS]


def hash_paths(root: Path, names: list[str] | None = None) -> str:
    """Digest of every file below ``root`` (or only the given names), their relative paths included."""
    digest = hashlib.sha256()
    files = sorted(p for p in root.rglob("*") if p.is_file()) if names is None else [root / n for n in sorted(names) if (root / n).is_file()]
    for path in files:
        digest.update(str(path.relative_to(root)).encode())
        with path.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()[:DIGEST_CHARS]


def hash_token_ids(dataset: datasets.Dataset) -> str:
    """Digest of a tokenized split: every ``*_ids`` column, row by row (lengths and ids)."""
    digest = hashlib.sha256()
    table = dataset.with_format("arrow")[:]
    for name in sorted(c for c in dataset.column_names if c.endswith("_ids")):
        column = table.column(name)
        digest.update(name.encode())
        digest.update(pc.list_value_length(column).to_numpy().astype("<i8").tobytes())
        digest.update(pc.list_flatten(column).to_numpy().astype("<i8").tobytes())
    return digest.hexdigest()[:DIGEST_CHARS]


@contextmanager
def atomic_directory(target: Path) -> Iterator[Path]:
    """Yield a temporary folder beside ``target`` and rename it into place only on success."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        yield staging
        if target.exists():  # another writer finished first; theirs is equivalent
            shutil.rmtree(staging)
        else:
            os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
