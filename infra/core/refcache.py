"""The reference log-prob cache: content-addressed entries of Parquet columns plus a manifest.

Layout under the cache root (a local folder, a ``file://`` URL or any fsspec URL such as
``s3://bucket/refcache``)::

    <root>/<key>/manifest.json              key inputs; rows and sha256 of each file; producer; timing
    <root>/<key>/<split>.parquet            row_id, ref_chosen_logps, ref_rejected_logps (a row's two
                                            scored completions: ``trainers/scoring/reference_views.py``)
    <root>/.staging/<key>.<unix time>.<id>/ an entry being written, moved to <root>/<key> when complete
    <root>/.locks/<key>.lock                held while an entry is computed

Every read checks the manifest's row counts and checksums, so a partial or corrupt entry is
never used; ``get_or_compute`` rebuilds it (with a warning) under the key's lock, which also
makes concurrent requests for one key compute it once. Pure storage: no Prefect, MLflow or torch.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Callable, Mapping, Sequence, TypedDict

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from infra.core.fingerprints import hash_value
from infra.core.locks import LeaseLock, LocalFileLock

logger = logging.getLogger("alignflow.refcache")

FORMAT = "alignflow-refcache-v1"
MANIFEST = "manifest.json"
STAGING = ".staging"
LOCKS = ".locks"
SCHEMA = pa.schema([("row_id", pa.int64()), ("ref_chosen_logps", pa.float32()), ("ref_rejected_logps", pa.float32())])

Columns = tuple[Sequence[float], Sequence[float]]  # a row's two log-probs (chosen, rejected); row id = position
Compute = Callable[[], Mapping[str, Columns]]


class SplitFile(TypedDict):
    """A split's entry in the manifest's ``splits``."""

    file: str
    rows: int
    sha256: str


class CacheIntegrityError(ValueError):
    """An entry that must not be used; the message names the file and what is wrong with it."""


class EntryMissing(CacheIntegrityError):
    """No entry under this key (not an error: it is computed)."""


@dataclass(frozen=True)
class CacheEntry:
    uri: str
    manifest: dict
    tables: dict[str, pa.Table]  # split -> verified columns

    @property
    def key(self) -> str:
        return self.manifest["key"]

    @property
    def digest(self) -> str:
        return self.manifest["digest"]

    @property
    def rows(self) -> dict[str, int]:
        return {split: info["rows"] for split, info in self.manifest["splits"].items()}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def entry_digest(splits: Mapping[str, SplitFile]) -> str:
    """One digest of an entry's content: the checksums of its files."""
    return hash_value({split: info["sha256"] for split, info in splits.items()})


def parquet_bytes(chosen: Sequence[float], rejected: Sequence[float]) -> bytes:
    if len(chosen) != len(rejected):
        raise ValueError(f"{len(chosen)} chosen but {len(rejected)} rejected log-probs")
    table = pa.table(
        [pa.array(range(len(chosen)), pa.int64()), pa.array(chosen, pa.float32()), pa.array(rejected, pa.float32())],
        schema=SCHEMA,
    )
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    return buffer.getvalue()


def parse_duration(text: str) -> timedelta:
    """``90s``, ``30m``, ``12h``, ``7d``, ``2w``."""
    units = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}
    number, unit = text[:-1], text[-1:]
    if unit not in units or not number.replace(".", "", 1).isdigit():
        raise ValueError(f"duration {text!r}: expected a number followed by one of {''.join(units)} (e.g. 7d)")
    return timedelta(**{units[unit]: float(number)})


class ReferenceCache:
    def __init__(self, root: str, lock_timeout: float = 6 * 3600, lease_seconds: float = 120.0):
        self.root = str(root).rstrip("/")
        self.fs, self.base = fsspec.core.url_to_fs(self.root)
        self.lock_timeout, self.lease_seconds = lock_timeout, lease_seconds

    def uri(self, key: str) -> str:
        return f"{self.root}/{key}"

    def path(self, key: str) -> str:
        return f"{self.base}/{key}"

    def lock(self, key: str) -> LocalFileLock | LeaseLock:
        path = f"{self.base}/{LOCKS}/{key}.lock"
        if isinstance(self.fs, LocalFileSystem):
            return LocalFileLock(path, self.lock_timeout)
        return LeaseLock(self.fs, path, self.lock_timeout, self.lease_seconds)

    # -- reading ------------------------------------------------------------------------------

    def manifest(self, key: str) -> dict:
        """The entry's manifest, parsed but not verified against the files."""
        where = f"{self.uri(key)}/{MANIFEST}"
        try:
            manifest = json.loads(self.fs.cat_file(f"{self.path(key)}/{MANIFEST}"))
        except FileNotFoundError:
            if self.fs.exists(self.path(key)):
                raise CacheIntegrityError(f"{where}: missing (partial entry)") from None
            raise EntryMissing(f"{self.uri(key)}: no such entry") from None
        except ValueError as error:
            raise CacheIntegrityError(f"{where}: not valid JSON ({error})") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("key") != key:
            raise CacheIntegrityError(f"{where}: not a {FORMAT} manifest for key {key}")
        return manifest

    def read(self, key: str, expected_rows: dict[str, int] | None = None) -> CacheEntry:
        """The verified entry: every file's sha256 and row count match the manifest (and
        ``expected_rows``, the prepared data's, when given); else :class:`CacheIntegrityError`."""
        manifest = self.manifest(key)
        try:
            splits = manifest["splits"]
            tables = {split: self.read_split(key, info) for split, info in splits.items()}
            digest_ok = manifest["digest"] == entry_digest(splits)
        except (KeyError, TypeError, AttributeError) as error:
            raise CacheIntegrityError(f"{self.uri(key)}/{MANIFEST}: malformed ({error!r})") from None
        if not digest_ok:
            raise CacheIntegrityError(f"{self.uri(key)}/{MANIFEST}: digest does not match the file checksums")
        entry = CacheEntry(self.uri(key), manifest, tables)
        if expected_rows is not None and entry.rows != expected_rows:
            raise CacheIntegrityError(
                f"{self.uri(key)}: rows {entry.rows} differ from the prepared data's {expected_rows}"
            )
        return entry

    def read_split(self, key: str, info: SplitFile) -> pa.Table:
        where = f"{self.uri(key)}/{info['file']}"
        try:
            data = self.fs.cat_file(f"{self.path(key)}/{info['file']}")
        except FileNotFoundError:
            raise CacheIntegrityError(f"{where}: missing") from None
        if sha256(data) != info["sha256"]:
            raise CacheIntegrityError(
                f"{where}: sha256 of its {len(data)} bytes does not match the manifest (corrupt or truncated)"
            )
        try:
            table = pq.read_table(io.BytesIO(data))
        except pa.ArrowException as error:
            raise CacheIntegrityError(f"{where}: unreadable Parquet ({error})") from None
        if table.schema != SCHEMA or table.num_rows != info["rows"]:
            raise CacheIntegrityError(
                f"{where}: {table.num_rows} rows of {table.schema.names}, "
                f"manifest says {info['rows']} rows of {SCHEMA.names}"
            )
        return table

    # -- writing ------------------------------------------------------------------------------

    def get_or_compute(
        self,
        key: str,
        compute: Compute,
        inputs: dict,
        producer: dict | None = None,
        expected_rows: dict[str, int] | None = None,
    ) -> tuple[CacheEntry, bool]:
        """The verified entry and whether this call computed it. A missing, partial or corrupt
        entry is (re)computed once under the key's lock; whoever waited on the lock reads it."""
        try:
            return self.read(key, expected_rows), False
        except CacheIntegrityError:
            pass  # decided, and reported, under the lock
        with self.lock(key):
            try:
                return self.read(key, expected_rows), False
            except EntryMissing:
                pass
            except CacheIntegrityError as problem:
                logger.warning("reference cache entry %s is unusable and will be rebuilt: %s", key, problem)
            self.write(key, compute, inputs, producer or {})
            return self.read(key, expected_rows), True

    def write(self, key: str, compute: Compute, inputs: dict, producer: dict) -> None:
        """Compute the columns, write them and the manifest to a staging folder, then move it
        into place (callers hold the key's lock)."""
        created = datetime.now(timezone.utc)
        started = time.perf_counter()
        columns = compute()
        seconds = time.perf_counter() - started
        staging = f"{self.base}/{STAGING}/{key}.{int(created.timestamp())}.{uuid.uuid4().hex[:8]}"
        self.fs.makedirs(staging, exist_ok=True)
        try:
            splits: dict[str, SplitFile] = {}
            for split, (chosen, rejected) in columns.items():
                data = parquet_bytes(chosen, rejected)
                self.fs.pipe_file(f"{staging}/{split}.parquet", data)
                splits[split] = {"file": f"{split}.parquet", "rows": len(chosen), "sha256": sha256(data)}
            rows = sum(info["rows"] for info in splits.values())
            manifest = {
                "format": FORMAT,
                "key": key,
                "digest": entry_digest(splits),
                "inputs": inputs,
                "splits": splits,
                "created_at": created.isoformat(),
                "producer": {**producer, "host": socket.gethostname(), "pid": os.getpid()},
                "timing": {
                    "compute_seconds": seconds,
                    "rows": rows,
                    "rows_per_second": rows / seconds if seconds > 0 else None,
                },
            }
            self.fs.pipe_file(f"{staging}/{MANIFEST}", json.dumps(manifest, indent=2).encode())
            if self.fs.exists(self.path(key)):
                self.fs.rm(self.path(key), recursive=True)
            self.fs.mv(staging, self.path(key), recursive=True)
        except BaseException:
            if self.fs.exists(staging):
                self.fs.rm(staging, recursive=True)
            raise

    # -- maintenance --------------------------------------------------------------------------

    def keys(self) -> list[str]:
        if not self.fs.exists(self.base):
            return []
        folders = [
            info["name"].rstrip("/").rsplit("/", 1)[-1]
            for info in self.fs.ls(self.base, detail=True)
            if info["type"] == "directory"
        ]
        return sorted(name for name in folders if not name.startswith("."))  # not .staging, .locks

    def size(self, key: str) -> int:
        return sum(self.fs.du(self.path(key), total=False).values())

    def remove(self, key: str) -> None:
        with self.lock(key):
            if self.fs.exists(self.path(key)):
                self.fs.rm(self.path(key), recursive=True)

    def gc(self, older_than: timedelta, now: datetime | None = None, dry_run: bool = False) -> list[str]:
        """Remove complete entries created before ``now - older_than`` and abandoned staging
        folders as old; partial or corrupt entries are left to ``verify --delete`` or a rebuild."""
        cutoff = (now or datetime.now(timezone.utc)) - older_than
        removed = []
        for key in self.keys():
            try:
                created = datetime.fromisoformat(self.manifest(key)["created_at"])
            except (CacheIntegrityError, KeyError, ValueError):
                continue
            if created < cutoff:
                removed.append(key)
                if not dry_run:
                    self.remove(key)
        staging = f"{self.base}/{STAGING}"
        for folder in self.fs.ls(staging, detail=False) if self.fs.exists(staging) else []:
            name = folder.rstrip("/").rsplit("/", 1)[-1]
            parts = name.split(".")
            if len(parts) == 3 and parts[1].isdigit() and datetime.fromtimestamp(int(parts[1]), timezone.utc) < cutoff:
                removed.append(f"{STAGING}/{name}")
                if not dry_run:
                    self.fs.rm(folder, recursive=True)
        return removed
