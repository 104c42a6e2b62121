"""``alignflow servers up | down | status``: a Prefect server and an MLflow tracking server.

Each server is one process group started in its own session, with its files under
``<run-state>/servers/<name>/``: ``server.log``, ``pid`` and ``server.json`` (URLs, database).
Both bind 127.0.0.1 by default and keep their data on SQLite in that folder; given a PostgreSQL
URL they use it instead, creating the database first if it is missing. Unless started with
``--no-auth`` they refuse every request without credentials (Prefect's API auth string, MLflow's
``basic-auth`` app), which are generated once and kept in ``servers/credentials.json`` (0600):
never in ``server.json``, a log or a command line.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from pydantic import BaseModel, ValidationError

from infra.core.launching import ProcessGroup
from infra.core.mlflow_compat import basic_auth_config, default_allowed_hosts
from infra.core.ports import bind_error
from infra.core.processes import ProcessRecord, is_alive, listening_pids, pid_alive, process_record
from infra.core.settings import Settings, redact_url

HEALTH_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 20.0
# How long the MLflow server trusts a password it has verified (mlflow_compat.basic_auth_config). It
# has one worker, so a password changed through MLflow's API is dropped at once; one changed in its
# user store directly is still taken until then.
MLFLOW_AUTH_CACHE_S = 60
MLFLOW_AUTH_CONFIG_FILE = "basic_auth.ini"  # in the MLflow server's folder


CREDENTIALS_FILE = "credentials.json"  # in servers/, mode 0600


@dataclass(frozen=True)
class Credentials:
    """The secrets of servers that authenticate (all but ``--no-auth`` ones): random, made once per state folder."""

    prefect_auth_string: str
    mlflow_password: str
    mlflow_secret_key: str  # Flask's key for the basic-auth app's CSRF tokens
    mlflow_username: str = "alignflow"  # MLflow's admin user, created at the server's first start

    @classmethod
    def generate(cls) -> Credentials:
        return cls(secrets.token_urlsafe(32), secrets.token_urlsafe(24), secrets.token_urlsafe(32))

    def client_environment(self, server: str) -> dict[str, str]:
        """What a client of ``server`` sets to authenticate (Prefect's and MLflow's own variables)."""
        if server == "prefect":
            return {"PREFECT_API_AUTH_STRING": self.prefect_auth_string}
        return {"MLFLOW_TRACKING_USERNAME": self.mlflow_username, "MLFLOW_TRACKING_PASSWORD": self.mlflow_password}


def read_credentials(root: Path) -> Credentials | None:
    try:
        return Credentials(**json.loads((root / CREDENTIALS_FILE).read_text()))
    except FileNotFoundError:
        return None


def ensure_credentials(root: Path) -> Credentials:
    """This state folder's server credentials, generated and written (0600, never wider) on first use."""
    if (found := read_credentials(root)) is not None:
        return found
    root.mkdir(parents=True, exist_ok=True)
    made = Credentials.generate()
    descriptor = os.open(root / CREDENTIALS_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as file:
        json.dump(asdict(made), file)
    return made


@dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"
    prefect_port: int = 4200
    mlflow_port: int = 5000
    prefect_database_url: str | None = None
    mlflow_database_url: str | None = None
    artifacts_destination: str | None = None
    credentials: Credentials | None = None  # given: the servers refuse requests without them


@dataclass(frozen=True)
class ServerSpec:
    name: str
    url: str  # what users open and clients reach
    health_url: str
    command: list[str]
    env: dict[str, str]
    exports: dict[str, str]  # what clients set to use this server
    database_url: str
    postgres_url: str | None = None  # a PostgreSQL database to create if missing
    artifacts: str | None = None  # where an MLflow server keeps artifacts
    auth: bool = False  # clients need the credentials (:class:`Credentials`)
    files: dict[str, str] = field(default_factory=dict)  # name → text, written into its folder before it starts


class ServerRecord(BaseModel):
    """``server.json``: what ``alignflow servers up`` wrote of a server it started, for ``status``,
    ``env`` and the clients that look for it (no credential: those are in ``credentials.json``)."""

    url: str
    health_url: str
    exports: dict[str, str]  # what clients set to use it
    database: str  # redacted
    auth: bool
    artifacts: str | None = None  # MLflow's artifact store


WILDCARD_HOSTS = ("0.0.0.0", "::")


def client_host(host: str) -> str:
    """The address clients use: a wildcard bind is reached through this machine's name."""
    return socket.getfqdn() if host in WILDCARD_HOSTS else host


def local_host(host: str) -> str:
    return "127.0.0.1" if host in WILDCARD_HOSTS else host


def with_driver(url: str, driver: str) -> str:
    """``postgresql://…`` → ``postgresql+<driver>://…`` (each server needs its own driver); other URLs unchanged."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.drivername == "postgresql":
        parsed = parsed.set(drivername=f"postgresql+{driver}")
    return parsed.render_as_string(hide_password=False)


def prefect_auth(credentials: Credentials) -> dict[str, str]:
    """The server's auth string, and the same for its own services' clients of its API."""
    server = {"PREFECT_SERVER_API_AUTH_STRING": credentials.prefect_auth_string}
    return {**server, **credentials.client_environment("prefect")}


def prefect_server(options: ServerOptions, folder: Path) -> ServerSpec:
    url = f"http://{client_host(options.host)}:{options.prefect_port}"
    database = (
        with_driver(options.prefect_database_url, "asyncpg")
        if options.prefect_database_url
        else f"sqlite+aiosqlite:///{folder / 'prefect.db'}"
    )
    return ServerSpec(
        name="prefect",
        url=url,
        health_url=f"http://{local_host(options.host)}:{options.prefect_port}/api/health",
        command=[
            sys.executable,
            "-m",
            "prefect",
            "server",
            "start",
            "--host",
            options.host,
            "--port",
            str(options.prefect_port),
        ],
        env={
            "PREFECT_HOME": str(folder),
            "PREFECT_API_DATABASE_CONNECTION_URL": database,
            "PREFECT_UI_API_URL": f"{url}/api",  # the browser's API address, also from other machines
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "DO_NOT_TRACK": "1",
            **(prefect_auth(options.credentials) if options.credentials else {}),
        },
        exports={"PREFECT_API_URL": f"{url}/api"},
        database_url=database,
        postgres_url=options.prefect_database_url,
        auth=options.credentials is not None,
    )


def mlflow_server(options: ServerOptions, folder: Path) -> ServerSpec:
    url = f"http://{client_host(options.host)}:{options.mlflow_port}"
    store = (
        with_driver(options.mlflow_database_url, "psycopg2")
        if options.mlflow_database_url
        else f"sqlite:///{folder / 'mlflow.db'}"
    )
    artifacts = options.artifacts_destination or str(folder / "artifacts")
    command = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--host",
        options.host,
        "--port",
        str(options.mlflow_port),
        "--artifacts-destination",
        artifacts,
        "--workers",
        "1",
    ]
    if options.host in WILDCARD_HOSTS and not os.environ.get("MLFLOW_SERVER_ALLOWED_HOSTS"):
        # MLflow answers only Host headers it allows (localhost and private IPs by default); add the name clients use.
        command += [
            "--allowed-hosts",
            ",".join([*default_allowed_hosts(), client_host(options.host), f"{client_host(options.host)}:*"]),
        ]
    auth, files = {}, {}
    if options.credentials is not None:
        # MLflow's basic-auth app: its user store is basic_auth.db in the server's folder (its working
        # folder); the admin user it creates at the first start is alignflow's client.
        command += ["--app-name", "basic-auth"]
        files = {MLFLOW_AUTH_CONFIG_FILE: basic_auth_config(MLFLOW_AUTH_CACHE_S)}
        auth = {
            "MLFLOW_AUTH_ADMIN_USERNAME": options.credentials.mlflow_username,
            "MLFLOW_AUTH_ADMIN_PASSWORD": options.credentials.mlflow_password,
            "MLFLOW_FLASK_SERVER_SECRET_KEY": options.credentials.mlflow_secret_key,
            "MLFLOW_AUTH_CONFIG_PATH": str(folder / MLFLOW_AUTH_CONFIG_FILE),
        }
    return ServerSpec(
        name="mlflow",
        url=url,
        health_url=f"http://{local_host(options.host)}:{options.mlflow_port}/health",
        command=command,
        env={
            # MLflow's GenAI job runner (8 extra processes) serves nothing alignflow logs; set it to true to keep it.
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": os.environ.get("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false"),
            # Through the environment (readable by this user only), not the command line (readable by every
            # local user): the URL may hold the database password.
            "MLFLOW_BACKEND_STORE_URI": store,
            **auth,
        },
        exports={"MLFLOW_TRACKING_URI": url},
        database_url=store,
        postgres_url=options.mlflow_database_url,
        artifacts=artifacts,
        auth=options.credentials is not None,
        files=files,
    )


SERVERS: dict[str, Callable[[ServerOptions, Path], ServerSpec]] = {"prefect": prefect_server, "mlflow": mlflow_server}


def ensure_postgres_database(url: str) -> bool:
    """Create the URL's database on its server if it is missing; True when it was created."""
    from sqlalchemy.engine import make_url

    try:
        import psycopg2
        from psycopg2 import sql
    except ImportError as error:
        raise RuntimeError("PostgreSQL URLs need psycopg2: pip install 'alignflow[postgres]'") from error
    parsed = make_url(url)
    if not parsed.database:
        raise ValueError(f"{redact_url(url)}: the URL names no database")
    connection = psycopg2.connect(
        host=parsed.host, port=parsed.port or 5432, user=parsed.username, password=parsed.password, dbname="postgres"
    )
    try:
        connection.autocommit = True  # CREATE DATABASE cannot run in a transaction
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1 FROM pg_database WHERE datname = %s", (parsed.database,))
            if cursor.fetchone() is not None:
                return False
            cursor.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(parsed.database)))
            return True
    finally:
        connection.close()


RECORD_FILE = "server.json"  # the server's ServerRecord
PROCESS_FILE = "process.json"  # the server's process record (pid, start tick, boot id), written at start


def servers_dir(settings: Settings) -> Path:
    return settings.root / "servers"


def read_pid(folder: Path) -> int | None:
    """The server's pid while the process recorded at its start runs (same boot, same start tick);
    None when there is none, or when the pid now names another process: a stale pid file is never
    taken for the server, so nothing signals a stranger."""
    try:
        record = ProcessRecord.from_tags(json.loads((folder / PROCESS_FILE).read_text()))
    except (OSError, ValueError):
        return None
    return record.pid if record is not None and is_alive(record) else None


def host_and_port(url: str) -> tuple[str, int]:
    """The host and port a server's URL names (a health URL names both)."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.hostname is None or parsed.port is None:
        raise ValueError(f"{url}: names no host and port")
    return parsed.hostname, parsed.port


def port_in_use(url: str) -> str | None:
    """Why the host and port of ``url`` cannot be bound (another process listens there), or None."""
    host, port = host_and_port(url)
    error = bind_error(host, port)
    return None if error is None else f"port {port} on {host} is not free ({error.strerror})"


def answered_by_group(health_url: str, pgid: int) -> bool:
    """False when the process listening on the health URL's port is known and outside process group
    ``pgid`` (another program answers there); True when it is ours or cannot be told."""
    pids = listening_pids(host_and_port(health_url)[1])
    if not pids:
        return True
    groups = set()
    for pid in pids:
        try:
            groups.add(os.getpgid(pid))
        except OSError:
            continue
    return not groups or pgid in groups


def is_healthy(health_url: str) -> bool:
    try:
        with urllib.request.urlopen(health_url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def log_tail(folder: Path, lines: int = 20) -> str:
    try:
        return "\n".join((folder / "server.log").read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def start(spec: ServerSpec, folder: Path) -> int:
    """Start the server in a new session (its own process group); returns its pid."""
    folder.mkdir(parents=True, exist_ok=True)
    if spec.postgres_url and ensure_postgres_database(spec.postgres_url):
        print(f"{spec.name}: created database {redact_url(spec.postgres_url)}")
    for name, text in spec.files.items():
        (folder / name).write_text(text)
    with open(folder / "server.log", "ab") as log:
        group = ProcessGroup.start(
            spec.command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **spec.env},
            cwd=folder,
            tied_to_parent=False,  # it outlives `alignflow servers up`
        )
    (folder / "pid").write_text(str(group.pgid))  # for people; alignflow reads the process record
    (folder / PROCESS_FILE).write_text(json.dumps(process_record(group.pgid).tags()))
    record = ServerRecord(
        url=spec.url,
        health_url=spec.health_url,
        exports=spec.exports,
        database=redact_url(spec.database_url),
        auth=spec.auth,
        artifacts=spec.artifacts,
    )
    (folder / RECORD_FILE).write_text(record.model_dump_json(indent=2))
    return group.pgid


def stop(folder: Path, timeout: float = STOP_TIMEOUT_S) -> bool:
    """Stop the server's whole process group (TERM, then KILL after ``timeout``); False if none ran."""
    pid = read_pid(folder)
    if pid is not None:
        ProcessGroup(pid).stop(grace=timeout)
    for name in ("pid", PROCESS_FILE):
        (folder / name).unlink(missing_ok=True)
    return pid is not None


def run_in_group(command: list[str], grace: float) -> int:
    """Run ``command`` in the foreground in a process group of its own. SIGTERM or SIGINT to this
    process is passed on to the whole group; whatever of the group is still alive ``grace`` seconds
    later is killed. Returns 0 after a requested shutdown, else the command's exit status."""
    group = ProcessGroup.start(command, stdin=None, tied_to_parent=False)
    deadline: list[float] = []  # set by the first stop signal

    def pass_on(signum, frame):
        if not deadline:
            deadline.append(time.monotonic() + grace)
        group.signal(signum)

    previous = {sig: signal.signal(sig, pass_on) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while (status := group.poll()) is None or (deadline and group.alive()):
            if deadline and time.monotonic() > deadline[0]:
                group.signal(signal.SIGKILL)
            time.sleep(0.2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0 if deadline else status


def wait_healthy(specs: dict[str, ServerSpec], folders: dict[str, Path], timeout: float) -> list[str]:
    """Wait until every server answers its health check; returns the names that did not. A server
    whose own process has died has failed even if something answers on its port (another process)."""
    pending = dict(specs)
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        for name, spec in list(pending.items()):
            pid = read_pid(folders[name])
            if pid is None or not pid_alive(pid):
                return [name, *[n for n in pending if n != name]]
            if is_healthy(spec.health_url):
                if not answered_by_group(spec.health_url, pid):
                    return [name, *[n for n in pending if n != name]]  # another process answers on its port
                del pending[name]
        time.sleep(0.5)
    return list(pending)


@dataclass(frozen=True)
class ServerStatus:
    name: str
    pid: int | None
    running: bool
    healthy: bool
    record: ServerRecord | None  # None: no readable server.json (never started here, or written over)


def server_status(name: str, folder: Path) -> ServerStatus:
    pid = read_pid(folder)
    running = pid is not None and pid_alive(pid)
    try:
        record = ServerRecord.model_validate_json((folder / RECORD_FILE).read_text())
    except (OSError, ValidationError):
        record = None
    healthy = running and record is not None and is_healthy(record.health_url)
    return ServerStatus(name, pid, running, healthy, record)


def exports(statuses: list[ServerStatus]) -> dict[str, str]:
    """What clients set to use the running servers (no credential: :func:`client_environment` adds them)."""
    return {
        key: value
        for status in statuses
        if status.running and status.record
        for key, value in status.record.exports.items()
    }


def client_environment(status: ServerStatus, root: Path) -> dict[str, str]:
    """A running server's exports, and the credentials it asks for (those of ``root``, the servers folder)."""
    if status.record is None:
        return {}
    found = dict(status.record.exports)
    if status.record.auth:
        credentials = read_credentials(root)
        if credentials is None:
            raise RuntimeError(f"{status.name} asks for credentials, and {root / CREDENTIALS_FILE} is gone")
        found.update(credentials.client_environment(status.name))
    return found
