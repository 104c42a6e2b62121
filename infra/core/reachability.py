"""Whether the MLflow tracking server answers, asked once with a short timeout before a run creates
anything: MLflow's own client retries for minutes (506 s), leaving RUNNING runs behind. The CLI
asks before a flow run exists; every flow asks again before its parent run (a run a worker or a
served deployment started never passed through the CLI)."""

from __future__ import annotations

import urllib.error
import urllib.parse
import urllib.request

from infra.core import mlflow_compat
from infra.core.settings import Settings, get_settings, redact_url


class TrackingServerUnreachable(RuntimeError):
    """The MLflow tracking server does not answer."""


class UnsupportedTrackingUri(ValueError):
    """The tracking URI has a scheme no MLflow tracking store takes."""


def unsupported_tracking_uri(settings: Settings) -> str | None:
    """Why the configured tracking URI cannot be used, naming the variable it came from, or None."""
    uri = settings.mlflow_tracking_uri
    scheme = mlflow_compat.tracking_uri_scheme(uri)
    if scheme in (schemes := mlflow_compat.tracking_schemes()):
        return None
    variable = "ALIGNFLOW_TRACKING_URI" if settings.tracking_uri else "MLFLOW_TRACKING_URI"
    known = ", ".join(f"{name}://" for name in sorted(filter(None, schemes)))
    return (
        f"{variable}={redact_url(uri)}: MLflow has no tracking store for the scheme {scheme!r}; "
        f"use one of {known} or a local path"
    )


def unreachable(uri: str, timeout: float = 5.0) -> str | None:
    """Why nothing answers at the MLflow tracking server ``uri`` (http or https), or None: any HTTP
    answer to ``/health`` counts, a 401 of an authenticating server too. Other URIs (a local store)
    are None. Credentials in the URI are not sent: reaching the server is what is asked."""
    parts = urllib.parse.urlsplit(uri)
    if parts.scheme not in ("http", "https"):
        return None
    netloc = parts.netloc.rpartition("@")[2]
    health = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path.rstrip("/") + "/health", "", ""))
    try:
        with urllib.request.urlopen(health, timeout=timeout):
            return None
    except urllib.error.HTTPError:
        return None
    except OSError as error:
        return str(getattr(error, "reason", error))


def require_tracking_server() -> None:
    """Raise :class:`UnsupportedTrackingUri` when no MLflow store takes the configured tracking URI,
    :class:`TrackingServerUnreachable`, naming the URI (redacted) and the cause, when the configured
    tracking server does not answer."""
    settings = get_settings()
    if (problem := unsupported_tracking_uri(settings)) is not None:
        raise UnsupportedTrackingUri(problem)
    uri = settings.mlflow_tracking_uri
    if (problem := unreachable(uri)) is not None:
        raise TrackingServerUnreachable(
            f"the MLflow tracking server {redact_url(uri)} does not answer ({problem}): start it (alignflow servers "
            "up mlflow), or point MLFLOW_TRACKING_URI (ALIGNFLOW_TRACKING_URI) at one that runs"
        )
