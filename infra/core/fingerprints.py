"""Content fingerprints (sha256) of files, folders, JSON-able values and the code that produces
cached content."""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata
import importlib.util
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
    files = (
        sorted(p for p in root.rglob("*") if p.is_file())
        if names is None
        else [root / n for n in sorted(names) if (root / n).is_file()]
    )
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


# Imports into this package are followed when hashing code: it is the pure-ML layer that computes
# cached content. tasks/, flows/ and infra/ orchestrate; a module of theirs counts only as a root.
CONTENT_PACKAGE = "trainers"
# Libraries whose version changes numerics or file formats of cached content.
LIBRARIES = ("torch", "transformers", "tokenizers", "datasets", "peft")


def module_source(name: str) -> Path | None:
    """The source file of module ``name`` (``a.b.c`` → ``a/b/c.py`` or ``a/b/c/__init__.py`` below
    package ``a``), found without importing anything; None for names that are not modules."""
    top, *parts = name.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    root = Path(spec.origin).parent if spec.submodule_search_locations else Path(spec.origin).with_suffix("")
    base = root.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_modules(tree: ast.AST) -> set[str]:
    """Every module an ``import`` / ``from … import`` names anywhere in ``tree`` (function bodies
    included); ``from package import name`` yields ``package.name`` as well, for submodules."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def is_content_module(name: str) -> bool:
    return name == CONTENT_PACKAGE or name.startswith(CONTENT_PACKAGE + ".")


@functools.cache
def code_fingerprint(*roots: str) -> str:
    """Digest of the source of the modules ``roots`` and of every ``trainers`` module they import,
    transitively, plus the versions of the libraries that shape the numbers (``LIBRARIES``).

    Part of every cache key of computed content: a change to the code that produces an entry
    misses the cache, with no version constant to bump. Source files are not imported."""
    sources: dict[str, bytes] = {}
    pending = list(roots)
    while pending:
        name = pending.pop()
        if name in sources or (path := module_source(name)) is None:
            continue
        sources[name] = path.read_bytes()
        pending.extend(m for m in imported_modules(ast.parse(sources[name])) if is_content_module(m))
    digest = hashlib.sha256()
    for name in sorted(sources):
        digest.update(f"{name}\n".encode() + sources[name])
    for library in LIBRARIES:
        digest.update(f"{library}=={importlib.metadata.version(library)}".encode())
    return digest.hexdigest()[:DIGEST_CHARS]


def staging_name(target: Path) -> str:
    return f".{target.name}.tmp-"


def staging_copies(target: Path) -> list[Path]:
    """The temporary folders of :func:`atomic_directory` beside ``target``: being written, or left by
    a killed process."""
    return sorted(target.parent.glob(staging_name(target) + "*"))


@contextmanager
def atomic_directory(target: Path) -> Iterator[Path]:
    """Yield a temporary folder beside ``target`` and rename it into place only on success. A
    symlink at ``target`` is not ours: it is removed, never followed, and the folder takes its place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f"{staging_name(target)}{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        yield staging
        if target.is_symlink():
            target.unlink()
        if target.exists():  # another writer finished first; theirs is equivalent
            shutil.rmtree(staging)
        else:
            try:
                os.replace(staging, target)
            except OSError:  # ... between the check and the rename (concurrent runs, e.g. a sweep's trials)
                if not target.exists():
                    raise
                shutil.rmtree(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
