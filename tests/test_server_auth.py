"""`alignflow servers up` (authentication is the default): a Prefect and an MLflow server (SQLite, free
loopback ports) that refuse requests without the credentials, another local user's too, and a
pipeline run that uses them and stores them nowhere: not in its output, the logs, the Prefect
database, MLflow's params and tags, or any command line. `--no-auth` opts out."""

from __future__ import annotations

import base64
import os
import shlex
import shutil
import stat
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import ALIGNFLOW, NEEDS_AUTH_MLFLOW, alignflow, environment_without_services

from infra.core.mlflow_compat import basic_auth_config
from infra.core.ports import free_port
from infra.core.processes import environment
from infra.ops import servers

pytestmark = [pytest.mark.services, NEEDS_AUTH_MLFLOW]

PROJECT_ROOT = Path(__file__).resolve().parents[1]
RUN = ["run", "configs/minimal.yaml", "name=authed", "stages=[sft]", "sft.max_steps=2", "evaluation.num_prompts=4"]


@dataclass
class AuthedServers:
    home: Path
    env: dict[str, str]  # a user's shell after `eval "$(alignflow servers env)"`
    credentials: servers.Credentials
    prefect_url: str
    mlflow_url: str
    up_output: str

    @property
    def secrets(self) -> list[str]:
        return [self.credentials.prefect_auth_string, self.credentials.mlflow_password]


def status_of(url: str, headers: dict[str, str] | None = None, data: bytes | None = None) -> int:
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


ANOTHER_USER = "nobody"


def status_as_another_user(url: str, data: str | None = None) -> int:
    """The status of a request from a process of another local user (`nobody`, through `runuser` and
    `curl`: this interpreter may lie in a folder only its owner reads), which holds none of this
    user's files or environment."""
    runuser, curl = shutil.which("runuser"), shutil.which("curl")
    if os.geteuid() != 0 or runuser is None or curl is None:
        pytest.skip("acting as another local user needs root, runuser and curl")
    command = [runuser, "-u", ANOTHER_USER, "--", curl, "-s", "-o", "/dev/null", "-w", "%{http_code}"]
    command += ["-H", "Content-Type: application/json", *(["--data", data] if data is not None else []), url]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd="/", env={"PATH": os.defpath})
    assert result.returncode == 0, result.stderr
    return int(result.stdout)


def basic(user_and_password: str) -> dict[str, str]:
    return {"Authorization": f"Basic {base64.b64encode(user_and_password.encode()).decode()}"}


@pytest.fixture(scope="module")
def authed(tmp_path_factory):
    home = tmp_path_factory.mktemp("authed")
    ports = {"prefect": free_port(), "mlflow": free_port()}
    base = environment_without_services("ALIGNFLOW_") | {"ALIGNFLOW_HOME": str(home), "OMP_NUM_THREADS": "1"}
    up = alignflow(base, "servers", "up", "--prefect-port", str(ports["prefect"]), "--mlflow-port",
                   str(ports["mlflow"]))  # fmt: skip
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        exported = alignflow(base, "servers", "env")
        assert exported.returncode == 0, exported.stderr
        env = dict(base)
        for line in exported.stdout.splitlines():
            key, _, value = line.removeprefix("export ").partition("=")
            env[key] = shlex.split(value)[0]
        credentials = servers.read_credentials(home / "servers")
        yield AuthedServers(
            home,
            env,
            credentials,
            f"http://127.0.0.1:{ports['prefect']}",
            f"http://127.0.0.1:{ports['mlflow']}",
            up.stdout + up.stderr,
        )
    finally:
        down = alignflow(base, "servers", "down", timeout=120)
        assert down.returncode == 0, down.stdout + down.stderr


def test_servers_refuse_requests_without_the_credentials(authed):
    credentials = authed.credentials
    flow_runs = f"{authed.prefect_url}/api/flow_runs/filter"
    assert status_of(flow_runs, data=b"{}") == 401
    assert status_of(flow_runs, basic("guess"), b"{}") == 401
    assert status_of(flow_runs, basic(credentials.prefect_auth_string), b"{}") == 200
    experiments = f"{authed.mlflow_url}/api/2.0/mlflow/experiments/search?max_results=1"
    assert status_of(experiments) == 401
    assert status_of(experiments, basic(f"{credentials.mlflow_username}:guess")) == 401
    assert status_of(experiments, basic(f"{credentials.mlflow_username}:{credentials.mlflow_password}")) == 200
    # MLflow keeps the verified password for a while (servers.MLFLOW_AUTH_CACHE_S): another one is still refused
    assert status_of(experiments, basic(f"{credentials.mlflow_username}:{credentials.mlflow_password}")) == 200
    assert status_of(experiments, basic(f"{credentials.mlflow_username}:guess")) == 401
    mlflow_folder = authed.home / "servers" / "mlflow"
    settings = f"MLFLOW_AUTH_CONFIG_PATH={mlflow_folder / servers.MLFLOW_AUTH_CONFIG_FILE}".encode()
    assert settings in environment(servers.read_pid(mlflow_folder))
    assert (mlflow_folder / servers.MLFLOW_AUTH_CONFIG_FILE).read_text() == basic_auth_config(
        servers.MLFLOW_AUTH_CACHE_S
    )
    # `servers env` gave the credentials; `servers up` printed the URLs and where the credentials are, not them
    assert authed.env["PREFECT_API_AUTH_STRING"] == credentials.prefect_auth_string
    assert authed.env["MLFLOW_TRACKING_PASSWORD"] == credentials.mlflow_password
    assert f"export PREFECT_API_URL={authed.prefect_url}/api" in authed.up_output
    assert not [secret for secret in authed.secrets if secret in authed.up_output]
    mode = (authed.home / "servers" / servers.CREDENTIALS_FILE).stat().st_mode
    assert stat.S_IMODE(mode) == 0o600
    records = [
        servers.ServerRecord.model_validate_json((authed.home / "servers" / name / servers.RECORD_FILE).read_text())
        for name in servers.SERVERS
    ]
    assert [record.auth for record in records] == [True, True]


def test_another_local_user_can_neither_list_experiments_nor_create_flows(authed):
    """By default (no --auth given), not just this user's own requests without the credentials."""
    assert status_as_another_user(f"{authed.mlflow_url}/api/2.0/mlflow/experiments/search?max_results=1") == 401
    assert status_as_another_user(f"{authed.prefect_url}/api/flows/", '{"name": "intruder"}') == 401
    assert status_as_another_user(f"{authed.prefect_url}/api/flow_runs/filter", "{}") == 401


def test_no_auth_opts_out_and_says_who_can_use_the_server(tmp_path):
    port = free_port()
    base = environment_without_services("ALIGNFLOW_") | {"ALIGNFLOW_HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    up = alignflow(base, "servers", "up", "prefect", "--no-auth", "--prefect-port", str(port))
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert up.stderr == "alignflow servers: --no-auth: every local user can use these servers' APIs\n"
        assert status_as_another_user(f"http://127.0.0.1:{port}/api/flows/", '{"name": "anyone"}') == 201
        record = servers.ServerRecord.model_validate_json(
            (tmp_path / "servers" / "prefect" / servers.RECORD_FILE).read_text()
        )
        assert not record.auth and not (tmp_path / "servers" / servers.CREDENTIALS_FILE).exists()
    finally:
        down = alignflow(base, "servers", "down", timeout=120)
        assert down.returncode == 0, down.stdout + down.stderr


def command_lines() -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            found.append(cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    return found


def test_a_run_with_the_credentials_is_tracked_and_stores_them_nowhere(authed):
    """The run finds the Prefect server of its state folder by itself and MLflow through the exports;
    while it runs no process's command line holds a credential; afterwards no output, log, database
    (the Prefect server's included) or MLflow param or tag does."""
    from mlflow import MlflowClient

    with subprocess.Popen(
        [*ALIGNFLOW, *RUN],
        env={key: value for key, value in authed.env.items() if key != "PREFECT_API_URL"},
        cwd=PROJECT_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as run:
        seen: set[str] = set()
        while run.poll() is None:
            seen.update(command_lines())
            time.sleep(0.5)
        out, err = run.communicate(timeout=300)
    assert run.returncode == 0, err[-3000:]
    assert not [line for line in seen for secret in authed.secrets if secret in line]
    assert not [secret for secret in authed.secrets if secret in out + err]
    stored = [
        str(path)
        for path in sorted(authed.home.rglob("*"))
        if path.is_file() and path.name != servers.CREDENTIALS_FILE
        for secret in authed.secrets
        if secret.encode() in path.read_bytes()
    ]
    assert stored == []
    client = MlflowClient(authed.mlflow_url)
    with pytest.MonkeyPatch.context() as patch:  # MLflow's client reads the credentials from the environment
        patch.setenv("MLFLOW_TRACKING_USERNAME", authed.credentials.mlflow_username)
        patch.setenv("MLFLOW_TRACKING_PASSWORD", authed.credentials.mlflow_password)
        runs = client.search_runs([client.get_experiment_by_name("alignflow").experiment_id])
        assert {run.info.run_name for run in runs} >= {"authed", "sft"}
        assert {run.info.status for run in runs} == {"FINISHED"}
        logged = [str(value) for run in runs for value in (*run.data.params.values(), *run.data.tags.values())]
    assert logged and not [value for value in logged for secret in authed.secrets if secret in value]
