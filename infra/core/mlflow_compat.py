"""Every use of an MLflow internal (outside its documented client API) in alignflow, in one place.

Supported: MLflow :data:`SUPPORTED` (pyproject.toml's range); ``tests/test_compat.py`` checks that
each name below still exists and behaves as this module assumes. When MLflow moves one, this
module and that test are what change. MLflow is imported on use only: importing this module is cheap.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from requests import Response

SUPPORTED = ("3.9", "3.18")  # >= the first, < the second: pyproject.toml's "mlflow>=3.9,<3.18"
# Tracking servers' REST endpoint for a batch of metrics, params and tags (the documented REST API).
LOG_BATCH_ENDPOINT = "/api/2.0/mlflow/runs/log-batch"
# The tag of a run's dataset input that says what the dataset was for ("training", "evaluation", …):
# mlflow.utils.mlflow_tags.MLFLOW_DATASET_CONTEXT.
DATASET_CONTEXT_TAG = "mlflow.data.context"


# The URI schemes MLflow's own tracking stores take (mlflow.tracking._tracking_service.utils registers
# them): a local file store (no scheme, file), Databricks, a tracking server, SQLAlchemy databases.
# MLflow registers "databricks-uc" and "uc" too, whose builder refuses them as tracking URIs.
TRACKING_SCHEMES = ("", "file", "databricks", "http", "https", "postgresql", "mysql", "sqlite", "mssql")
DATABASE_SCHEMES = ("postgresql", "mysql", "sqlite", "mssql")  # mlflow.store.db.db_types.DATABASE_ENGINES
TRACKING_STORE_PLUGINS = "mlflow.tracking_store"  # the entry-point group of plugins' tracking stores


def tracking_uri_scheme(uri: str) -> str:
    """The scheme MLflow picks a tracking store by (``mlflow.utils.uri.get_uri_scheme``): a database
    URI's without its ``+driver``, none for a Windows drive letter; a bare ``databricks`` is itself."""
    import urllib.parse

    if uri == "databricks":
        return uri
    scheme = urllib.parse.urlsplit(uri).scheme
    if scheme.startswith(DATABASE_SCHEMES):
        return scheme.split("+", 1)[0]
    return "" if len(scheme) == 1 and scheme.isalpha() else scheme


def tracking_schemes() -> list[str]:
    """Every scheme a tracking URI may have here: MLflow's own and those of installed plugins
    (read from their entry points, without importing MLflow)."""
    import importlib.metadata

    plugins = [entry.name for entry in importlib.metadata.entry_points(group=TRACKING_STORE_PLUGINS)]
    return [*TRACKING_SCHEMES, *plugins]


def rest_poster(tracking_uri: str, timeout: float) -> Callable[[str, dict[str, Any]], Response]:
    """``post(endpoint, body)``: POST ``body`` as JSON to the tracking server's REST ``endpoint``, once
    (no urllib3 retries; MLflow's client would retry for minutes), for at most ``timeout`` seconds,
    returning the answer whatever its status; ``MlflowException`` when the server does not answer.
    The credentials are MLflow's for that URI (``MLFLOW_TRACKING_USERNAME``/``_PASSWORD``/``_TOKEN``, …),
    read once."""
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    credentials = get_default_host_creds(tracking_uri)

    def post(endpoint: str, body: dict[str, Any]) -> Response:
        return http_request(
            credentials, endpoint, "POST", max_retries=0, timeout=timeout, raise_on_status=False, json=body
        )

    return post


def default_allowed_hosts() -> list[str]:
    """The Host headers ``mlflow server`` answers by default (localhost, private networks), to which
    ``--allowed-hosts`` adds names: giving that option replaces the defaults."""
    from mlflow.server.security_utils import get_default_allowed_hosts

    return list(get_default_allowed_hosts())


def delete_artifacts(artifact_uri: str, path: str) -> None:
    """Delete ``path`` below a run's artifact root (MlflowClient has no call for it)."""
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    get_artifact_repository(artifact_uri).delete_artifacts(path)


# The columns of MLflow's SQL stores that hold artifact URIs: a run's and an experiment's artifact
# root, a logged model's, and a registered model version's source and storage location
# (mlflow/store/tracking/dbmodels/models.py, mlflow/store/model_registry/dbmodels/models.py).
ARTIFACT_URI_COLUMNS = (
    ("experiments", "artifact_location"),
    ("runs", "artifact_uri"),
    ("logged_models", "artifact_location"),
    ("model_versions", "source"),
    ("model_versions", "storage_location"),
)


def relocate_artifact_uris(database: Path, old_prefix: str, new_prefix: str) -> int:
    """In the SQLite store ``database``, point every artifact URI below ``old_prefix`` (a folder's
    ``file://`` URI) to the same place below ``new_prefix``; the number of values changed. For a
    store whose folder was copied or moved: its artifacts would otherwise still be read from, and
    written to, the old folder. MLflow has no call for it (an experiment's artifact location is fixed)."""
    import sqlite3

    old, new = old_prefix.rstrip("/") + "/", new_prefix.rstrip("/") + "/"
    with contextlib.closing(sqlite3.connect(database, timeout=30)) as db, db:
        return sum(
            db.execute(
                f"UPDATE {table} SET {column} = ? || substr({column}, ?) WHERE substr({column}, 1, ?) = ?",
                (new, len(old) + 1, len(old), old),
            ).rowcount
            for table, column in ARTIFACT_URI_COLUMNS
        )


# The basic-auth app's settings file (``MLFLOW_AUTH_CONFIG_PATH``; MLflow's own is
# mlflow/server/auth/basic_auth.ini): the keys it requires, as MLflow ships them, and the cache.
BASIC_AUTH_DATABASE = "sqlite:///basic_auth.db"  # the user store, relative to the server's working folder
BASIC_AUTH_DEFAULT_PERMISSION = "READ"


# The first MLflow whose basic-auth app creates its admin user from MLFLOW_AUTH_ADMIN_USERNAME and
# MLFLOW_AUTH_ADMIN_PASSWORD. Before it (3.9-3.16) the admin comes from the settings file only:
# alignflow's file holds no password (only servers/credentials.json does), so those versions fail to
# start on it, and on MLflow's shipped file they created its default admin, admin / password1234.
BASIC_AUTH_ADMIN_FROM_ENVIRONMENT = (3, 17)


def installed_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("mlflow")


def basic_auth_admin_from_environment(version: str) -> bool:
    """Whether MLflow ``version``'s basic-auth app takes its admin from the environment (``servers up
    --auth`` refuses to start MLflow otherwise)."""
    major, minor = (int(part) for part in version.split(".")[:2])
    return (major, minor) >= BASIC_AUTH_ADMIN_FROM_ENVIRONMENT


def basic_auth_config(cache_seconds: int) -> str:
    """The basic-auth app's settings: MLflow's user store and default permission, and its cache of
    verified credentials for ``cache_seconds`` (0: off, MLflow's default). Without the cache each
    request checks its password against the stored scrypt hash, ~0.3 CPU s per request on the
    one-worker server, which answers one request at a time: a two-step tracked run took 2.3x as long
    (benchmarks/mlflow_auth.py). A hit skips only that check (the key is an HMAC of the password with
    a per-process secret); a wrong password is checked every time. MLflow versions without the cache
    ignore the key."""
    return (
        "[mlflow]\n"
        f"default_permission = {BASIC_AUTH_DEFAULT_PERMISSION}\n"
        f"database_uri = {BASIC_AUTH_DATABASE}\n"
        f"auth_cache_ttl_seconds = {cache_seconds}\n"
    )
