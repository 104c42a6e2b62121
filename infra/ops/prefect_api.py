"""Which Prefect API a command talks to, decided before Prefect is imported (``infra.ops.cli.run_flow``).

In order: ``PREFECT_API_URL`` when set; else the Prefect server that ``alignflow servers up``
runs for this state folder, when it answers; else a temporary local server, as Prefect would
start by itself, but launched at once so that it boots on the other core while this process
imports torch, transformers and the flows (Prefect starts its own only at the first API call,
after those imports, and then waits for it). It is stopped when the process exits, after
Prefect's own exit hooks have sent their last logs and events. It refuses every API request without
a random auth string that only this process and its children hold (in their environment, which
only the owner can read): another local user cannot list its flow runs or their configs.
"""

from __future__ import annotations

import atexit
import os
import secrets
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

from infra.core.launching import ProcessGroup
from infra.core.ports import free_port
from infra.core.prefect_compat import TEMPORARY_SERVER_ENV, temporary_server_command
from infra.core.settings import get_settings
from infra.ops.servers import client_environment, is_healthy, server_status, servers_dir

STARTUP_TIMEOUT_S = 90.0  # PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, unless set
STOP_GRACE_S = 1.0
PORT_IN_USE_EXIT = 3  # uvicorn's exit code when its port was taken meanwhile


@dataclass
class TemporaryServer:
    """Prefect's temporary API server (the command Prefect's ``SubprocessASGIServer`` runs: the API
    app on SQLite under ``PREFECT_HOME``, no UI), a process group tied to this process. ``home``:
    the ``PREFECT_HOME`` of its database (None: this process's); ``auth_string`` None: no auth."""

    port: int
    log: Path
    group: ProcessGroup | None = None
    auth_string: str | None = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)
    home: Path | None = None

    @classmethod
    def of_state_folder(cls) -> "TemporaryServer":
        """A server on a free port, logging to the state folder's ``logs/``."""
        return cls(free_port(), get_settings().root / "logs" / "temporary-prefect-server.log")

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    @property
    def client_environment(self) -> dict[str, str]:
        """What a Prefect client needs to talk to it: the URL and the auth string."""
        auth = {} if self.auth_string is None else {"PREFECT_API_AUTH_STRING": self.auth_string}
        return {"PREFECT_API_URL": self.api_url, **auth}

    def launch(self) -> None:
        """Start it (a Ctrl-C reaches the run, which still reports to the server, not the server)."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **TEMPORARY_SERVER_ENV}
        env.pop("PREFECT_API_URL", None)
        if self.auth_string is not None:
            env["PREFECT_SERVER_API_AUTH_STRING"] = self.auth_string
        if self.home is not None:
            env["PREFECT_HOME"] = str(self.home)
        with self.log.open("ab") as log:
            self.group = ProcessGroup.start(
                temporary_server_command(self.port), env=env, stdout=log, stderr=subprocess.STDOUT
            )

    @property
    def launched(self) -> ProcessGroup:
        """Its process group, once :meth:`launch` started it."""
        if self.group is None:
            raise RuntimeError("the temporary Prefect API server was not launched")
        return self.group

    def wait_ready(self, timeout: float | None = None, meanwhile: Iterable[Callable[[], object]] = ()) -> None:
        """Block until the API answers; a port taken meanwhile is retried on another one. The steps
        ``meanwhile`` run one by one while it does not answer yet (those left then are skipped)."""
        deadline = time.monotonic() + (
            timeout or float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", STARTUP_TIMEOUT_S))
        )
        steps = iter(meanwhile)
        while time.monotonic() < deadline:
            if is_healthy(f"{self.api_url}/health"):
                return
            if self.launched.poll() == PORT_IN_USE_EXIT:
                pointed_here = os.environ.get("PREFECT_API_URL") == self.api_url
                self.port = free_port()
                if pointed_here:  # start_temporary_server's clients follow it to the new port
                    os.environ["PREFECT_API_URL"] = self.api_url
                self.launch()
            elif self.launched.poll() is not None:
                break
            elif (step := next(steps, None)) is not None:
                step()
                continue
            time.sleep(0.05)
        tail = self.log.read_text(errors="replace").splitlines()[-15:] if self.log.exists() else []
        raise RuntimeError(
            f"the temporary Prefect API server did not start (exit code {self.launched.poll()}); "
            f"its log, {self.log}:\n" + "\n".join(tail)
        )

    def stop(self) -> None:
        """Stop its group: nothing to finish, every state was written already."""
        if self.group is not None and self.group.poll() is None:
            self.group.stop(grace=STOP_GRACE_S)


def servers_up_environment() -> dict[str, str] | None:
    """What a client sets to use the Prefect server ``alignflow servers up`` runs for this state folder
    (its URL, and its auth string when it has one), if it answers."""
    root = servers_dir(get_settings())
    status = server_status("prefect", root / "prefect")
    return client_environment(status, root) if status.healthy else None


def configured_prefect_api() -> dict[str, str] | None:
    """What to set to use the configured Prefect API: nothing when ``PREFECT_API_URL`` is set, else
    this state folder's ``alignflow servers up`` server when it answers; None: a temporary server is needed."""
    return {} if os.environ.get("PREFECT_API_URL") else servers_up_environment()


def start_temporary_server() -> TemporaryServer:
    """Launch a temporary server and point ``PREFECT_API_URL`` at it (call before importing prefect;
    :meth:`TemporaryServer.wait_ready` before the first API call). It stops at exit."""
    server = TemporaryServer.of_state_folder()
    server.launch()
    os.environ.update(server.client_environment)
    os.environ.setdefault("PREFECT_UI_URL", "")  # it serves no UI: no links to it in MLflow or the logs
    atexit.register(server.stop)  # registered before Prefect's hooks, so it runs after them
    return server


@contextmanager
def shared_prefect_api() -> Iterator[None]:
    """One Prefect API for this process and every process it starts (a sweep's Dask workers): each
    would otherwise start its own temporary server on the same database. ``PREFECT_API_URL`` when
    set, else a temporary server for the duration of the block."""
    if os.environ.get("PREFECT_API_URL"):
        yield
        return
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    from infra.ops.databases import first_time_setup

    with first_time_setup(temporary_prefect=True) as setup:
        server = TemporaryServer.of_state_folder()
        server.launch()
        setup.create_mlflow_store()  # on a fresh folder: while the server migrates its database
        server.wait_ready()
    os.environ.update(server.client_environment)
    try:
        with temporary_settings({PREFECT_API_URL: server.api_url, PREFECT_API_AUTH_STRING: server.auth_string}):
            yield
    finally:
        for name in server.client_environment:
            os.environ.pop(name, None)
        server.stop()
