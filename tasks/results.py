"""Prefect's cached results for alignflow's tasks: JSON that cannot run code, and handles whose
files are checked on every hit.

Prefect keeps a cached result as a record file named by its cache key, and the record names the
serializer that decodes it: whoever can write the file chooses, and ``pickle`` (or a JSON
serializer with another ``object_decoder``) runs code as soon as Prefect checks that the record
exists. So every cached task writes JSON into :data:`RESULTS` and its cache key function is
wrapped in :func:`checked_cache_key`: before Prefect reads the record, it is parsed as plain
data and kept only if it is Prefect's default JSON serializer holding exactly one known handle
whose files are present and match their fingerprints. Anything else is moved aside
(``<key>.rejected-<time>``) with a warning, and Prefect computes the result anew.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Callable, TypedDict

from infra.core.fingerprints import hash_paths
from infra.core.handles import Handle, ModelHandle, PreparedData, ReferenceLogps
from infra.core.prefect_compat import ENCODED_TYPE_KEYS, default_json_serializer, encoded_object, result_record_parts
from infra.core.settings import get_settings

logger = logging.getLogger("alignflow.results")

RESULT_SERIALIZER = "json"
# Fixed at import: the tasks' decorators take it, and a process keeps one state folder.
RESULTS = get_settings().prefect_results
HANDLE_TYPES: dict[str, type[Handle]] = {
    f"{cls.__module__}.{cls.__qualname__}": cls for cls in (ModelHandle, PreparedData, ReferenceLogps)
}


class ResultOptions(TypedDict):
    persist_result: bool
    result_serializer: str
    result_storage: Path


# The result options of every cached task: ``@task(cache_key_fn=checked_cache_key(key_fn), **CACHED_RESULT)``.
CACHED_RESULT: ResultOptions = {
    "persist_result": True,
    "result_serializer": RESULT_SERIALIZER,
    "result_storage": RESULTS,
}


class RejectedResult(ValueError):
    """A cached result record that is not used (the message says why)."""


def decoded_keys(value: Any) -> list[str]:
    """Every ``__class__`` / ``__exc_type__`` key below ``value`` (the top level excluded)."""
    found = []
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
    for child in children:
        if isinstance(child, dict):
            found += [key for key in ENCODED_TYPE_KEYS if key in child]
        found += decoded_keys(child)
    return found


def parse_record(content: bytes) -> Handle:
    """The handle in a record file, read as plain JSON; :class:`RejectedResult` unless the record is
    Prefect's default JSON serializer around one of :data:`HANDLE_TYPES` and nothing else it would import."""
    try:
        serializer, result = result_record_parts(content)
    except ValueError as error:
        raise RejectedResult(f"not a JSON result record ({error})") from None
    if serializer != default_json_serializer():
        raise RejectedResult(f"written with serializer {serializer!r}, not Prefect's default JSON serializer")
    try:
        value = json.loads(result)
    except (ValueError, TypeError) as error:
        raise RejectedResult(f"its result is not JSON ({type(error).__name__}: {error})") from None
    obj = encoded_object(value)
    if obj is None or obj[0] not in HANDLE_TYPES:
        raise RejectedResult(f"holds {str(value)[:80]!r}, not one of {sorted(HANDLE_TYPES)}")
    if nested := decoded_keys(value):
        raise RejectedResult(f"holds encoded objects ({', '.join(nested)}) inside its handle")
    name, data = obj
    try:
        return HANDLE_TYPES[name].model_validate(data)
    except ValueError as error:
        raise RejectedResult(f"its {name} does not validate: {error}") from None


def check_model(handle: ModelHandle) -> None:
    """A local checkpoint folder exists and hashes to the handle's fingerprint (hub ids: nothing to check)."""
    if not Path(handle.path).is_absolute():
        return
    if not Path(handle.path).is_dir():
        raise RejectedResult(f"its model folder {handle.path} is missing")
    if hash_paths(Path(handle.path)) != handle.fingerprint:
        raise RejectedResult(f"the files of {handle.path} no longer match its fingerprint")


def check_data(handle: PreparedData) -> None:
    if not Path(handle.path).is_dir():
        raise RejectedResult(f"its prepared data folder {handle.path} is missing")


def check_reference_logps(handle: ReferenceLogps) -> None:
    """What a missing or corrupt cache entry is rebuilt from (the entry itself is verified on use)."""
    check_data(handle.data)
    check_model(handle.reference)


CHECKS: dict[type[Handle], Callable[[Any], None]] = {
    ModelHandle: check_model,
    PreparedData: check_data,
    ReferenceLogps: check_reference_logps,
}


def validate_record(key: str, results: Path = RESULTS) -> None:
    """Keep the record of ``key`` only if :func:`parse_record` accepts it and its handle's files check out."""
    path = results / key
    if not path.is_file():
        return
    try:
        handle = parse_record(path.read_bytes())
        CHECKS[type(handle)](handle)
    except RejectedResult as reason:
        aside = path.with_name(f"{path.name}.rejected-{time.strftime('%Y%m%dT%H%M%S')}")
        path.rename(aside)
        logger.warning("cached result %s is not used and is computed again: %s (moved to %s)", key, reason, aside)


def checked_cache_key(key_fn: Callable[[Any, dict], str | None]) -> Callable[[Any, dict], str | None]:
    """``key_fn`` as a Prefect ``cache_key_fn`` whose record, if any, passes :func:`validate_record` first."""

    def cache_key(context, parameters) -> str | None:
        key = key_fn(context, parameters)
        if key is not None:
            validate_record(key)
        return key

    cache_key.__doc__ = key_fn.__doc__
    return cache_key
