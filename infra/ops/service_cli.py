"""Operations commands of the ``alignflow`` CLI: ``servers``, ``deploy``, ``serve``, ``worker``."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from infra.core import mlflow_compat
from infra.core.settings import get_settings, open_state_folder
from infra.ops import servers

DEFAULT_POOL = "alignflow-process"


def add_parsers(commands) -> None:
    """Add the operations subcommands to the ``alignflow`` subparsers."""
    server = commands.add_parser(
        "servers",
        help="start, stop or check a Prefect server and an MLflow tracking server",
        description="A Prefect server and an MLflow tracking server for a team, under $ALIGNFLOW_HOME/servers/ "
        "(logs, pid files); SQLite by default, PostgreSQL when URLs are given (databases are created if missing).",
        epilog="example: alignflow servers up --prefect-database-url postgresql://postgres@127.0.0.1:5432/prefect "
        "--mlflow-database-url postgresql://postgres@127.0.0.1:5432/mlflow",
    )
    server.add_argument(
        "action",
        choices=sorted(SERVER_ACTIONS),
        help="up: start and wait until healthy; down: stop; status: check; env: print client exports "
        "(with the credentials of servers that ask for them)",
    )
    server.add_argument(
        "names", nargs="*", metavar="server", help=f"which servers (default: all of {', '.join(servers.SERVERS)})"
    )
    defaults = servers.ServerOptions()
    server.add_argument(
        "--host", default=defaults.host, help="interface to bind (default: %(default)s; 0.0.0.0 for other machines)"
    )
    server.add_argument("--prefect-port", type=int, default=defaults.prefect_port, help="default: %(default)s")
    server.add_argument("--mlflow-port", type=int, default=defaults.mlflow_port, help="default: %(default)s")
    server.add_argument(
        "--prefect-database-url", help="PostgreSQL URL for Prefect (default: SQLite in the server folder)"
    )
    server.add_argument(
        "--mlflow-database-url", help="PostgreSQL URL for MLflow runs (default: SQLite in the server folder)"
    )
    server.add_argument(
        "--artifacts-destination", help="MLflow artifact root: a shared folder or s3://… (default: the server folder)"
    )
    auth = server.add_mutually_exclusive_group()
    auth.add_argument(
        "--auth",
        dest="auth",
        action="store_const",
        const=True,
        default=True,
        help="refuse requests without credentials (made once, kept in $ALIGNFLOW_HOME/servers/credentials.json; "
        "runs of this state folder find them, `servers env` prints them): the default",
    )
    auth.add_argument(
        "--no-auth",
        dest="auth",
        action="store_const",
        const=False,
        help="serve without authentication: every local user (on a wildcard --host, every machine that reaches "
        "it) can use both APIs",
    )
    server.add_argument(
        "--timeout",
        type=float,
        default=servers.HEALTH_TIMEOUT_S,
        help="seconds to wait for health (default: %(default)s)",
    )

    prefect_file = dict(type=Path, default=None, help="deployments file (default: the project's prefect.yaml)")
    deploy = commands.add_parser(
        "deploy",
        help="register prefect.yaml's deployments on the Prefect server",
        description="Create missing work pools, then `prefect deploy` the deployments of prefect.yaml.",
    )
    deploy.add_argument("--name", action="append", help="only this deployment (repeatable; default: all)")
    deploy.add_argument("--prefect-file", **prefect_file)

    serve = commands.add_parser(
        "serve",
        help="serve prefect.yaml's deployments, with their schedules, from this process",
        description="Single-machine alternative to deploy + workers: flow runs start as subprocesses of this process.",
    )
    serve.add_argument("--name", action="append", help="only this deployment (repeatable; default: all)")
    serve.add_argument("--prefect-file", **prefect_file)
    serve.add_argument("--limit", type=int, default=None, help="maximum concurrent flow runs (default: no limit)")

    worker = commands.add_parser(
        "worker", help="start a process worker: `prefect worker start --pool … --type process`"
    )
    worker.add_argument("--pool", default=DEFAULT_POOL, help="work pool (default: %(default)s)")
    worker.add_argument("--limit", type=int, default=None, help="maximum concurrent flow runs (default: no limit)")
    worker.add_argument(
        "--grace",
        type=float,
        default=10.0,
        help="seconds the worker (and its flow runs) get to stop after SIGTERM/SIGINT before they are killed",
    )

    generation = commands.add_parser(
        "vllm-server",
        help="serve a vLLM engine for GRPO in server mode (vllm_mode: server) on this machine's devices",
        description="A vLLM engine that GRPO trainers elsewhere load their policy into, push its weights to after "
        "each update, and sample from (docs/algorithms/grpo.md). It holds no model until a trainer loads one. It "
        "answers only requests with the token in ALIGNFLOW_VLLM_TOKEN, which its trainers set too.",
        epilog='example: export ALIGNFLOW_VLLM_TOKEN="$(python -c '
        "'import secrets; print(secrets.token_urlsafe(32))')\"; "
        "alignflow vllm-server --host 0.0.0.0 --port 8100 --weights-root /shared/vllm-transfer; "
        "then, with the same ALIGNFLOW_VLLM_TOKEN, grpo.vllm_server_url=http://THIS-HOST:8100 "
        "grpo.vllm_transfer_folder=/shared/vllm-transfer",
    )
    generation.add_argument("--host", default="127.0.0.1", help="interface to bind (default: %(default)s)")
    generation.add_argument("--port", type=int, default=0, help="default: a free port, printed once listening")
    generation.add_argument(
        "--weights-root",
        type=Path,
        required=True,
        help="the folder (shared storage) the trainers' models and weights arrive in; it reads nothing outside it",
    )


def require_prefect_server() -> str | None:
    """The Prefect API URL, the state folder opened for the command's work; None (said) when none is set."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        print(
            "alignflow: this needs a Prefect server: set PREFECT_API_URL (`alignflow "
            'servers up` prints it, `eval "$(alignflow servers env)"` sets it)',
            file=sys.stderr,
        )
        return None
    open_state_folder()
    return url


def server_folders(names: list[str]) -> dict[str, Path]:
    unknown = sorted(set(names) - set(servers.SERVERS))
    if unknown:
        raise SystemExit(
            f"alignflow servers: unknown server {', '.join(unknown)} (known: {', '.join(servers.SERVERS)})"
        )
    root = servers.servers_dir(get_settings())
    return {name: root / name for name in names or servers.SERVERS}


def print_exports(environment: dict[str, str]) -> None:
    for key, value in environment.items():
        print(f"export {key}={shlex.quote(value)}")


def mlflow_auth_refusal() -> str | None:
    """Why ``servers up`` (authenticating) must not start the installed MLflow, if it must not."""
    version = mlflow_compat.installed_version()
    if mlflow_compat.basic_auth_admin_from_environment(version):
        return None
    wanted = ".".join(map(str, mlflow_compat.BASIC_AUTH_ADMIN_FROM_ENVIRONMENT))
    return (
        f"authentication (the default) needs MLflow {wanted} or later, this is MLflow {version}: its basic-auth "
        f"app takes the admin's password from its settings file only, and alignflow keeps passwords in servers/"
        f"{servers.CREDENTIALS_FILE} alone. Upgrade it (pip install 'mlflow[auth]>={wanted},"
        f"<{mlflow_compat.SUPPORTED[1]}'), or serve without authentication (--no-auth)"
    )


def servers_up_refusal(args: argparse.Namespace, folders: dict[str, Path]) -> str | None:
    """Why ``servers up`` must not start these servers with these options, if it must not."""
    return mlflow_auth_refusal() if args.auth and "mlflow" in folders else None


def servers_up(args: argparse.Namespace, folders: dict[str, Path]) -> int:
    if not args.auth:
        reach = "every machine that reaches it" if args.host in servers.WILDCARD_HOSTS else "every local user"
        print(f"alignflow servers: --no-auth: {reach} can use these servers' APIs", file=sys.stderr)
    root = servers.servers_dir(get_settings())
    options = servers.ServerOptions(
        args.host,
        args.prefect_port,
        args.mlflow_port,
        args.prefect_database_url,
        args.mlflow_database_url,
        args.artifacts_destination,
        servers.ensure_credentials(root) if args.auth else None,
    )
    specs, conflicts = {}, []
    for name, folder in folders.items():
        status = servers.server_status(name, folder)
        if status.running:
            print(
                f"{name}: already running (pid {status.pid}) at "
                f"{status.record.url if status.record else folder}; `alignflow servers down {name}` to restart it"
            )
            continue
        spec = servers.SERVERS[name](options, folder)
        if busy := servers.port_in_use(spec.health_url):
            print(
                f"alignflow: {name}: {busy}: another process uses it; stop it or choose another port", file=sys.stderr
            )
            conflicts.append(name)
            continue
        specs[name] = spec
        pid = servers.start(spec, folder)
        print(f"{name}: started (pid {pid}), log {folder / 'server.log'}")
    failed = servers.wait_healthy(specs, folders, args.timeout)
    for name in failed:
        print(
            f"alignflow: {name} did not become healthy at {specs[name].health_url}; "
            f"last log lines:\n{servers.log_tail(folders[name])}",
            file=sys.stderr,
        )
        servers.stop(folders[name])
    statuses = [servers.server_status(name, folder) for name, folder in folders.items()]
    report(statuses)
    print_exports(servers.exports(statuses))
    if any(status.running and status.record and status.record.auth for status in statuses):
        print(f'# and the credentials (in {root / servers.CREDENTIALS_FILE}): eval "$(alignflow servers env)"')
    return 1 if failed or conflicts else 0


def servers_down(args: argparse.Namespace, folders: dict[str, Path]) -> int:
    for name, folder in folders.items():
        print(f"{name}: {'stopped' if servers.stop(folder) else 'not running'}")
    return 0


def report(statuses: list[servers.ServerStatus]) -> None:
    for status in statuses:
        state = (
            f"running (pid {status.pid}), {'healthy' if status.healthy else 'NOT healthy'}"
            if status.running
            else "stopped"
        )
        shown = status.record.model_dump(include={"url", "database", "artifacts"}) if status.record else {}
        details = ", ".join(f"{key} {value}" for key, value in shown.items() if value is not None)
        print(f"{status.name}: {state}" + (f"; {details}" if status.running and details else ""))


def servers_status(args: argparse.Namespace, folders: dict[str, Path]) -> int:
    statuses = [servers.server_status(name, folder) for name, folder in folders.items()]
    report(statuses)
    return 0 if all(status.healthy for status in statuses) else 3


def servers_env(args: argparse.Namespace, folders: dict[str, Path]) -> int:
    """The exports of the running servers with their credentials, for ``eval`` in the user's shell."""
    root = servers.servers_dir(get_settings())
    for name, folder in folders.items():
        status = servers.server_status(name, folder)
        if status.running:
            print_exports(servers.client_environment(status, root))
    return 0


SERVER_ACTIONS = {"up": servers_up, "down": servers_down, "status": servers_status, "env": servers_env}


def servers_command(args: argparse.Namespace) -> int:
    folders = server_folders(args.names)
    if args.action == "up" and (refusal := servers_up_refusal(args, folders)):
        print(f"alignflow servers: {refusal}", file=sys.stderr)
        return 2
    open_state_folder()
    return SERVER_ACTIONS[args.action](args, folders)


def deploy_command(args: argparse.Namespace) -> int:
    from infra.ops.deployments import PREFECT_FILE, deploy

    if not require_prefect_server():
        return 2
    return deploy(args.name, (args.prefect_file or PREFECT_FILE).resolve())


def serve_command(args: argparse.Namespace) -> int:
    from infra.ops.deployments import PREFECT_FILE, PROJECT_ROOT, pooled_deployments, served_deployments

    if not require_prefect_server():
        return 2
    from prefect import serve

    path = (args.prefect_file or PREFECT_FILE).resolve()
    os.chdir(PROJECT_ROOT)  # entrypoints and config paths are relative to it; flow runs start here
    deployments = served_deployments(args.name, path)
    if taken := pooled_deployments(deployments):
        print(
            f"alignflow: {', '.join(taken)} already deployed for workers (`alignflow deploy`); serving would "
            "replace their pull steps and break their workers' runs. Serve other names (--name), or delete "
            "those deployments first (`prefect deployment delete …`)",
            file=sys.stderr,
        )
        return 2
    serve(*deployments, limit=args.limit)
    return 0


def worker_command(args: argparse.Namespace) -> int:
    if not require_prefect_server():
        return 2
    command = [sys.executable, "-m", "prefect", "worker", "start", "--pool", args.pool, "--type", "process"]
    if args.limit:
        command += ["--limit", str(args.limit)]
    # A child in its own process group, not exec: Prefect's worker answers SIGTERM slowly (45 s and
    # more); this process passes the signal on and kills the group after --grace seconds.
    return servers.run_in_group(command, grace=args.grace)


def vllm_server_command(args: argparse.Namespace) -> int:
    from trainers.generation.server_auth import environment_token

    try:
        environment_token()  # the server refuses to start without it: said here, before vLLM imports
    except ValueError as error:
        print(f"alignflow vllm-server: {error}", file=sys.stderr)
        return 2
    command = [
        sys.executable,
        "-m",
        "trainers.generation.vllm_server",
        args.host,
        str(args.port),
        str(args.weights_root),
    ]
    return servers.run_in_group(command, grace=10.0)


COMMANDS = {
    "servers": servers_command,
    "deploy": deploy_command,
    "serve": serve_command,
    "worker": worker_command,
    "vllm-server": vllm_server_command,
}
