"""Cache policy of the tasks whose results are cached by content (SFT, reference log-probs): the
content key of the task, and a lock on it, so that runs which start the same work at the same
moment (a sweep's trials) compute it once: the first holds the key's lock while it computes, the
others wait, then find the cached result."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from prefect.cache_policies import CacheKeyFnPolicy, CachePolicy

from infra.core.locks import TaskLockManager
from infra.core.settings import get_settings


def task_lock_folder() -> Path:
    return get_settings().root / "locks" / "tasks"


def computed_once(cache_key_fn: Callable) -> CachePolicy:
    return CacheKeyFnPolicy(cache_key_fn=cache_key_fn).configure(
        isolation_level="SERIALIZABLE", lock_manager=TaskLockManager(task_lock_folder)
    )
