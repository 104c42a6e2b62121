"""Whether the MLflow tracking server answers, asked once with a short timeout before a run creates
anything: MLflow's own client retries for minutes (506 s), leaving RUNNING runs behind. The CLI
asks before a flow run exists; every flow asks again before its parent run (a run a worker or a
served deployment started never passed through the CLI)."""

from __future__ import annotations

import urllib.error
import urllib.parse
import urllib.request

from infra.core.settings import get_settings, redact_url


class TrackingServerUnreachable(RuntimeError):
    """The MLflow tracking server does not answer."""


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
    """Raise :class:`TrackingServerUnreachable`, naming the URI (redacted) and the cause, when the
    configured tracking server does not answer."""
    uri = get_settings().mlflow_tracking_uri
    if (problem := unreachable(uri)) is not None:
        raise TrackingServerUnreachable(
            f"the MLflow tracking server {redact_url(uri)} does not answer ({problem}): start it (alignflow servers "
            "up mlflow), or point MLFLOW_TRACKING_URI (ALIGNFLOW_TRACKING_URI) at one that runs"
        )
