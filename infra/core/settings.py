"""Where alignflow keeps its state and which Prefect / MLflow it talks to.

Embedded defaults: everything under one run-state folder (``.alignflow/``): Prefect's local
temporary API on SQLite, an MLflow SQLite store with a local artifact folder, outputs and
caches. ``ALIGNFLOW_*`` variables point elsewhere (``ALIGNFLOW_REFERENCE_CACHE``: the reference
log-prob cache, any fsspec URL, shared by every run and machine that reaches it);
``MLFLOW_TRACKING_URI`` and ``PREFECT_API_URL`` are honoured as usual.
"""

from __future__ import annotations

import logging
import os
import re
import urllib.parse
from functools import cached_property
from pathlib import Path

from pydantic_settings import BaseSettings, SettingsConfigDict

from infra.core import mlflow_compat


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ALIGNFLOW_")

    home: Path = Path(".alignflow")
    tracking_uri: str | None = None
    artifact_location: str | None = None
    reference_cache: str | None = None  # local folder or fsspec URL; default $home/cache/reference
    reference_lock_timeout: float = 6 * 3600  # seconds a flow waits for another to compute an entry
    stage_lock_timeout: float = 24 * 3600  # seconds a flow waits for an identical one to finish a stage
    mlflow_ui_url: str | None = None
    metrics_flush_timeout: float = 300.0  # seconds a stage's end waits for metrics buffered during an MLflow outage
    # folders, beside the project, that `data.chat_template` files may come from (os.pathsep between them)
    template_dirs: str = ""

    @cached_property
    def root(self) -> Path:
        return self.home.expanduser().resolve()

    @property
    def template_roots(self) -> list[Path]:
        """Where a ``data.chat_template`` file may lie: the project (the folder alignflow runs in) and
        each folder of ``ALIGNFLOW_TEMPLATE_DIRS``. A template's text reaches prompts, samples and the
        trained tokenizer, so a config must not name any file the worker can read."""
        listed = [Path(folder).expanduser().resolve() for folder in self.template_dirs.split(os.pathsep) if folder]
        return [Path.cwd().resolve(), *listed]

    @property
    def state_folders(self) -> list[Path]:
        """Folders of state and credentials, which no ``data.chat_template`` file may come from, whatever
        the template roots: this state folder (the servers' credentials, databases, checkpoints), and
        Prefect's and the Hugging Face hub's homes where they are set (API keys, tokens)."""
        homes = [os.environ.get(name) for name in ("PREFECT_HOME", "HF_HOME")]
        return [self.root, *(Path(home).expanduser().resolve() for home in homes if home)]

    @property
    def outputs(self) -> Path:
        return self.root / "outputs"

    @property
    def data_cache(self) -> Path:
        return self.root / "cache" / "data"

    @property
    def eval_cache(self) -> Path:
        return self.root / "cache" / "eval"

    @property
    def launches(self) -> Path:
        """Launch folders of the sharded reference passes, one per cache key (a stage's is in its folder)."""
        return self.root / "launches"

    @property
    def model_cache(self) -> Path:
        return self.root / "cache" / "models"

    @property
    def tokenizer_cache(self) -> Path:
        return self.root / "cache" / "tokenizers"

    @property
    def reference_cache_root(self) -> str:
        return self.reference_cache or str(self.root / "cache" / "reference")

    @property
    def prefect_results(self) -> Path:
        return self.root / "prefect-results"

    @property
    def mlflow_tracking_uri(self) -> str:
        return self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{self.root / 'mlflow.db'}"

    @property
    def mlflow_artifact_location(self) -> str | None:
        """Artifact root for new experiments; local stores keep artifacts next to the database."""
        if self.artifact_location:
            return self.artifact_location
        if self.mlflow_tracking_uri.startswith("sqlite:"):
            return (self.root / "mlartifacts").as_uri()  # one folder per experiment is added below it
        return None

    @property
    def mlflow_ui(self) -> str:
        """Base URL of the MLflow UI for links: the tracking server itself, else `mlflow ui`'s default address."""
        if self.mlflow_ui_url:
            return self.mlflow_ui_url.rstrip("/")
        if self.mlflow_tracking_uri.startswith(("http://", "https://")):
            return self.mlflow_tracking_uri.rstrip("/")
        return "http://127.0.0.1:5000"


def redact_url(text: str) -> str:
    """``text`` with every credential of the URLs in it replaced by ``***``: the password of a
    ``user:password@`` part (a lone ``token@``, but for a database URL's lone user), and the value
    of each query or fragment parameter whose name holds one of :data:`SECRET_PARAMETER_WORDS`. For
    every URL that is printed, logged, tagged or stored (link artifacts). Other text is unchanged."""
    return URL.sub(lambda url: PARAMETER.sub(redact_parameter, USERINFO.sub(redact_userinfo, url[0])), text)


# A URL parameter whose name (any case) holds one of these carries a credential: token, access_token,
# api_key, apikey, password, passwd, pwd, secret, client_secret, sig (Azure SAS), X-Amz-Signature,
# X-Amz-Credential, X-Amz-Security-Token, X-Goog-Signature, auth, session ids. Too wide is a value hidden
# for nothing; too narrow is a leaked credential.
SECRET_PARAMETER_WORDS = ("token", "key", "secret", "passw", "pwd", "sig", "credential", "auth", "session")
URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")
USERINFO = re.compile(r"^(?P<scheme>[^:]+://)(?P<user>[^:@/?#\s]*)(?::(?P<password>[^/?#\s]*))?@")
PARAMETER = re.compile(r"(?P<lead>[?&;#])(?P<name>[^=&;#?\s]+)=(?P<value>[^&;#\s'\"<>(){}\[\],]+)")


# SQLAlchemy dialects (any +driver): their URLs' lone user part is a database role, not a token.
DATABASE_URL = re.compile(r"(postgres|postgresql|mysql|mariadb|mssql|oracle|sqlite)(\+[\w-]+)?://", re.IGNORECASE)


def redact_userinfo(match: re.Match) -> str:
    if match["password"] is not None:
        return f"{match['scheme']}{match['user']}:***@"
    return match[0] if DATABASE_URL.match(match["scheme"]) else f"{match['scheme']}***@"


def redact_parameter(match: re.Match) -> str:
    secret = any(word in match["name"].lower() for word in SECRET_PARAMETER_WORDS)
    return f"{match['lead']}{match['name']}={'***' if secret else match['value']}"


def get_settings() -> Settings:
    return Settings()


class StateFolderError(RuntimeError):
    """The run-state folder cannot be created or written."""


def prepare_state_folder(root: Path) -> None:
    """Create the state folder with mode 0700 (checkpoints, pickled results and databases inside are
    then private whatever their own modes; an existing folder keeps its mode: a team may share one
    on purpose) and check at once that it is writable: a read-only folder must not surface minutes
    later as a timeout of the temporary Prefect server."""
    hint = "set ALIGNFLOW_HOME to a writable folder"
    try:
        if not root.is_dir():
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
            root.chmod(0o700)  # mkdir's mode is cut by the umask; this one is not
    except OSError as error:
        raise StateFolderError(f"state folder {root}: cannot create it: {error.strerror}; {hint}") from None
    probe = root / f".write-probe-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise StateFolderError(f"state folder {root}: not writable: {error.strerror}; {hint}") from None


# The state folder's own file:// URI as of the last command run in it: a folder copied or moved
# elsewhere finds another one there.
ORIGIN_FILE = "origin"


def adopt_moved_state_folder(root: Path) -> None:
    """A state folder copied or moved elsewhere keeps its MLflow SQLite store, whose artifact
    locations are absolute ``file://`` URIs: those below the folder it came from are pointed here,
    so a copy never writes into, or reads from, the original."""
    here, origin = root.as_uri(), root / ORIGIN_FILE
    recorded = origin.read_text().strip() if origin.is_file() else None
    if recorded == here:
        return
    if recorded is not None and (root / "mlflow.db").is_file():
        changed = mlflow_compat.relocate_artifact_uris(root / "mlflow.db", recorded, here)
        logging.getLogger("alignflow").warning(
            "state folder %s was copied or moved from %s: %d MLflow artifact locations now point here",
            root,
            recorded.removeprefix("file://"),
            changed,
        )
    staging = root / f".{ORIGIN_FILE}.tmp-{os.getpid()}"
    staging.write_text(here + "\n")
    staging.replace(origin)


def tracking_credentials_apart(settings: Settings) -> Settings:
    """An HTTP tracking URI's ``user:password@`` moved to MLflow's own ``MLFLOW_TRACKING_USERNAME`` /
    ``MLFLOW_TRACKING_PASSWORD`` (those already set win), for this process and its children. MLflow
    puts the URI into every request's error ("API request to <URI>/api/… failed"), which reaches
    Prefect's state messages, result records and logs: a URI without the password cannot leak it."""
    uri = settings.mlflow_tracking_uri
    parts = urllib.parse.urlsplit(uri)
    if parts.scheme not in ("http", "https") or "@" not in parts.netloc:
        return settings
    os.environ.setdefault("MLFLOW_TRACKING_USERNAME", urllib.parse.unquote(parts.username or ""))
    os.environ.setdefault("MLFLOW_TRACKING_PASSWORD", urllib.parse.unquote(parts.password or ""))
    bare = urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))
    os.environ["MLFLOW_TRACKING_URI"] = bare
    if settings.tracking_uri is not None:
        os.environ["ALIGNFLOW_TRACKING_URI"] = bare
    return settings.model_copy(update={"tracking_uri": bare if settings.tracking_uri is not None else None})


def open_state_folder(settings: Settings | None = None) -> None:
    """Make the state folder ready for work: created (0700) and writable, and adopted where it was
    copied or moved (its ``origin``). A command calls it where its work starts, so one that fails
    before (a bad config) leaves no folder behind."""
    root = (settings or get_settings()).root
    prepare_state_folder(root)
    adopt_moved_state_folder(root)


def configure_environment(settings: Settings | None = None, open_folder: bool = True) -> Settings:
    """Set process-wide defaults for Prefect and MLflow. Call before importing prefect. With
    ``open_folder`` false the state folder is left alone: the caller opens it (:func:`open_state_folder`)."""
    settings = tracking_credentials_apart(settings or get_settings())
    if open_folder:
        open_state_folder(settings)
    defaults = {
        "PREFECT_HOME": str(settings.root / "prefect"),
        # what libraries would otherwise leave in ~ or /tmp (the state folder holds everything)
        "MPLCONFIGDIR": str(settings.root / "cache" / "matplotlib"),
        "TORCHINDUCTOR_CACHE_DIR": str(settings.root / "cache" / "torchinductor"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        # MLflow reads DO_NOT_TRACK only as "true", and otherwise writes ~/.config/mlflow/telemetry.json
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
        "PREFECT_LOGGING_LOG_PRINTS": "true",
        "PREFECT_LOGGING_EXTRA_LOGGERS": "alignflow",  # e.g. the reference cache's rebuild warnings
        "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",  # ... also outside flow runs (CLI, tests)
        "MLFLOW_TRACKING_URI": settings.mlflow_tracking_uri,
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # Per-file progress bars become one Prefect log line per refresh; stages log progress themselves.
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
        "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",  # e.g. GRPO's completions table, read back to append
    }
    if redact_url(settings.mlflow_tracking_uri) != settings.mlflow_tracking_uri:
        # MLflow prints "View run … at: <tracking URI>…" when a run ends: not with credentials in it.
        defaults["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    return settings
