"""First-time set-up of the state folder's databases, one process at a time.

Two processes that create the MLflow SQLite store, or first-start the temporary Prefect server on a
fresh ``prefect.db``, at the same moment race in the schema migrations (``table … already exists``,
``duplicate column name …``). :func:`prepare_databases` runs both set-ups under a file lock in the
state folder and then writes ``databases-ready.json`` (the versions that migrated them), so later
starts skip the lock; a new MLflow or Prefect version migrates again, under the lock.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from infra.core.settings import Settings, get_settings

READY_FILE = "databases-ready.json"
LOCK_FILE = "locks/databases.lock"
LOCK_TIMEOUT_S = 600.0


def local_databases(settings: Settings, temporary_prefect: bool | None = None) -> dict[str, Path]:
    """The databases this process would create in the state folder: MLflow's when tracking to its
    SQLite store, Prefect's when it runs a temporary Prefect server (by default: when no
    ``PREFECT_API_URL`` is set)."""
    found = {}
    if settings.mlflow_tracking_uri.startswith("sqlite:///"):
        found["mlflow"] = Path(settings.mlflow_tracking_uri.removeprefix("sqlite:///"))
    if temporary_prefect if temporary_prefect is not None else not os.environ.get("PREFECT_API_URL"):
        found["prefect"] = Path(os.environ.get("PREFECT_HOME", settings.root / "prefect")) / "prefect.db"
    return found


def wanted_marker(databases: dict[str, Path]) -> dict[str, str]:
    import importlib.metadata

    return {name: importlib.metadata.version(name) for name in sorted(databases)}


def recorded_versions(marker: Path) -> dict[str, str]:
    try:
        return dict(json.loads(marker.read_text()))
    except (OSError, ValueError, TypeError):
        return {}


def is_ready(marker: Path, wanted: dict[str, str], databases: dict[str, Path]) -> bool:
    recorded = recorded_versions(marker)
    return all(recorded.get(name) == version for name, version in wanted.items()) and all(
        path.exists() for path in databases.values()
    )


def create_mlflow_store(uri: str) -> None:
    from mlflow import MlflowClient

    MlflowClient(uri).search_experiments(max_results=1)  # opening the store creates and migrates it


def start_prefect_server() -> None:
    """Start this process's temporary Prefect server (it migrates ``prefect.db`` before it answers);
    the flow run then uses this same server."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        client.api_healthcheck()


class Setup:
    """What a :func:`first_time_setup` block may do early: :meth:`create_mlflow_store` (e.g. while
    the temporary Prefect server boots); whatever it did not do runs after the block.
    ``first_time``: this process sets the databases up (the temporary server migrates a new one)."""

    def __init__(self, settings: Settings, pending: bool, first_time: bool = False):
        self.settings, self.mlflow_pending, self.first_time = settings, pending, first_time

    def create_mlflow_store(self) -> None:
        if self.mlflow_pending:
            create_mlflow_store(self.settings.mlflow_tracking_uri)
            self.mlflow_pending = False


@contextmanager
def first_time_setup(settings: Settings | None = None, temporary_prefect: bool | None = None) -> Iterator[Setup]:
    """Around the block that first starts this process's temporary Prefect server (when
    ``temporary_prefect``): while the state folder's databases are not ready, hold its set-up lock,
    create the MLflow store (in the block, or after it) and record both as ready; once ready, nothing."""
    from infra.core.locks import LocalFileLock

    settings = settings or get_settings()
    databases = local_databases(settings, temporary_prefect)
    marker, wanted = settings.root / READY_FILE, wanted_marker(databases)
    if not databases or is_ready(marker, wanted, databases):
        yield Setup(settings, pending=False)
        return
    with LocalFileLock(settings.root / LOCK_FILE, timeout=LOCK_TIMEOUT_S):
        ready = is_ready(marker, wanted, databases)  # another process finished the set-up meanwhile
        setup = Setup(settings, pending=not ready and "mlflow" in databases, first_time=not ready)
        yield setup
        if not ready:
            setup.create_mlflow_store()
            marker.write_text(json.dumps(recorded_versions(marker) | wanted))


def prepare_databases(settings: Settings | None = None, temporary_prefect: bool | None = None) -> None:
    """Create/migrate the local databases under the state folder's lock, once per version (the
    temporary Prefect server is Prefect's own, started by a first API call; by default when no
    ``PREFECT_API_URL`` is set)."""
    if temporary_prefect is None:
        temporary_prefect = not os.environ.get("PREFECT_API_URL")
    with first_time_setup(settings, temporary_prefect):
        if temporary_prefect:
            start_prefect_server()
