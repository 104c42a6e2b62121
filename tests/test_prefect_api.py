"""Which Prefect API the CLI uses, and the temporary server it starts early (a real one)."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from helpers import ALIGNFLOW, PROJECT, mlflow_client, state_folder_environment

from infra.core.ports import free_port
from infra.core.processes import process_record
from infra.ops import prefect_api, servers
from infra.ops.prefect_api import TemporaryServer, configured_prefect_api


@pytest.mark.unit
def test_a_configured_api_url_comes_first_then_a_servers_up_server(monkeypatch):
    served = {"PREFECT_API_URL": "http://127.0.0.1:4200/api", "PREFECT_API_AUTH_STRING": "s"}
    monkeypatch.setattr(prefect_api, "servers_up_environment", lambda: served)
    monkeypatch.setenv("PREFECT_API_URL", "http://prefect.example:4200/api")
    assert configured_prefect_api() == {}  # the environment's API, as it is
    monkeypatch.delenv("PREFECT_API_URL")
    assert configured_prefect_api() == served
    monkeypatch.setattr(prefect_api, "servers_up_environment", lambda: None)
    assert configured_prefect_api() is None  # a temporary server is needed


@pytest.mark.unit
def test_servers_up_environment_reads_a_healthy_record_only(tmp_path, monkeypatch, state_dir):
    folder = state_dir / "servers" / "prefect"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / servers.PROCESS_FILE).write_text(json.dumps(process_record().tags()))  # a live process
    record = servers.ServerRecord(
        url="http://127.0.0.1:9",
        health_url="http://127.0.0.1:9/api/health",
        exports={"PREFECT_API_URL": "http://127.0.0.1:9/api"},
        database="sqlite:///prefect.db",
        auth=False,
    )
    (folder / servers.RECORD_FILE).write_text(record.model_dump_json())
    try:
        status = servers.server_status("prefect", folder)
        assert (status.running, status.healthy, status.record) == (True, False, record)
        assert servers.exports([status]) == {"PREFECT_API_URL": "http://127.0.0.1:9/api"}
        assert prefect_api.servers_up_environment() is None  # alive, but nothing answers its health URL
        (folder / servers.RECORD_FILE).write_text('{"health_url": "http://127.0.0.1:9/api/health"}')  # not ours
        status = servers.server_status("prefect", folder)
        assert (status.running, status.healthy, status.record, servers.exports([status])) == (True, False, None, {})
    finally:
        for name in (servers.PROCESS_FILE, servers.RECORD_FILE):
            (folder / name).unlink()


NOBODY_PROBE = """
import json, sys, urllib.error, urllib.request
pid, url = sys.argv[1:]
try:
    open(f"/proc/{pid}/environ", "rb").read()
    environ = "read"
except PermissionError:
    environ = "refused"
request = urllib.request.Request(url, data=b"{}", headers={"Content-Type": "application/json"})
try:
    status = urllib.request.urlopen(request, timeout=10).status
except urllib.error.HTTPError as error:
    status = error.code
print(json.dumps({"environ": environ, "status": status}))
"""


def post_status(url: str, headers: dict[str, str]) -> int:
    request = urllib.request.Request(url, data=b"{}", headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


@pytest.mark.slow
def test_a_temporary_server_answers_only_its_owner_and_leaves_nothing_when_stopped(tmp_path, state_dir):
    """While it starts, the waiting process runs its steps one at a time, and none once it answers.
    It refuses every API request without its random auth string, which lives only in its owner's
    environment: another local user (``nobody``) can neither read that environment nor list the flow
    runs (``POST /api/flow_runs/filter``) and their configs."""
    server = TemporaryServer(free_port(), tmp_path / "server.log")
    server.launch()
    step_ends = []
    try:
        server.wait_ready(timeout=120, meanwhile=[lambda: time.sleep(0.2) or step_ends.append(time.monotonic())] * 3000)
        answered = time.monotonic()
        with urllib.request.urlopen(f"{server.api_url}/health", timeout=5) as response:
            assert json.load(response) is True
        assert 0 < len(step_ends) < 3000  # the server took seconds, not ten minutes
        assert answered - step_ends[-1] < 1.0  # one health check after the last step, not another step
        runs = f"{server.api_url}/flow_runs/filter"
        token = base64.b64encode(server.auth_string.encode()).decode()
        assert post_status(runs, {}) == 401
        assert post_status(runs, {"Authorization": f"Basic {base64.b64encode(b'guess').decode()}"}) == 401
        assert post_status(runs, {"Authorization": f"Basic {token}"}) == 200
        assert server.auth_string not in (tmp_path / "server.log").read_text()
        if os.geteuid() == 0 and Path("/usr/bin/python3").exists():  # a probe as another user (CI runs as root)
            probe = subprocess.run(
                ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "/usr/bin/python3", "-I", "-c"]
                + [NOBODY_PROBE, str(server.group.pgid), runs],
                capture_output=True,
                text=True,
                timeout=60,
                cwd="/",
            )
            assert json.loads(probe.stdout) == {"environ": "refused", "status": 401}, probe.stderr
    finally:
        server.stop()
    assert server.group.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(server.group.pgid, 0)  # its process group is gone


@pytest.mark.slow
def test_a_temporary_server_stops_when_the_process_that_started_it_is_killed(tmp_path, state_dir):
    """kill -9 of a run leaves no server: it gets SIGTERM when its parent dies."""
    starter = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from infra.core.ports import free_port\nfrom infra.ops.prefect_api import TemporaryServer\n"
            f"server = TemporaryServer(free_port(), __import__('pathlib').Path({str(tmp_path / 'server.log')!r}))\n"
            "server.launch(); server.wait_ready(120); print(server.group.pgid, flush=True); time.sleep(600)\n",
        ],
        cwd=PROJECT,
        stdout=subprocess.PIPE,
        text=True,
    )
    server_pid = int(starter.stdout.readline())
    os.kill(starter.pid, 9)
    starter.wait()
    for _ in range(100):
        if not Path(f"/proc/{server_pid}").exists() or "zombie" in Path(f"/proc/{server_pid}/status").read_text():
            break
        time.sleep(0.1)
    else:
        os.kill(server_pid, 9)
        raise AssertionError("the temporary server outlived the process that started it")


@pytest.mark.slow
def test_a_server_that_cannot_start_is_reported_at_once_with_its_log(tmp_path, monkeypatch):
    fake = tmp_path / "fake" / "uvicorn"  # a uvicorn that fails at start, first on the path
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "__main__.py").write_text("import sys\nprint('cannot bind: permission denied')\nsys.exit(1)\n")
    monkeypatch.setenv("PYTHONPATH", str(fake.parent))
    server = TemporaryServer(free_port(), tmp_path / "server.log")
    server.launch()
    with pytest.raises(RuntimeError, match=r"did not start \(exit code 1\); its log, .*server\.log:\ncannot bind"):
        server.wait_ready(timeout=60)


@pytest.mark.slow
def test_bad_input_fails_the_command_with_the_flow_code_and_one_line_and_leaves_nothing_behind(tmp_path):
    """`alignflow run` on the embedded default with one bad row: its own temporary server, the run's
    exit code through the teardown-free exit, one short error line naming file, row and field (no
    Prefect traceback on the terminal: where the full one is), no cache entry, the MLflow run FAILED,
    and no server process afterwards. Every row error takes this path (the messages of each kind of
    bad row are test_data.py's, in-process)."""
    env = state_folder_environment(tmp_path)
    bad = tmp_path / "pairs.jsonl"
    bad.write_text('{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n{"prompt": "2+2=", "chosen": "4"}\n')
    result = subprocess.run(
        [*ALIGNFLOW, "run", "configs/minimal.yaml", f"data.preference.path={bad}", "tracking.experiment_name=bad"],
        cwd=PROJECT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 1, result.stderr[-2000:]
    assert "Traceback (most recent call last)" not in result.stdout + result.stderr
    (error_line,) = [line for line in result.stderr.splitlines() if line.startswith("alignflow: ")]
    assert f"{bad}: row 1: field 'rejected' is missing" in error_line
    assert "full traceback: " in result.stderr and "(or run with --debug)" in result.stderr
    assert not (tmp_path / "cache" / "data").exists() or list((tmp_path / "cache" / "data").iterdir()) == []
    client = mlflow_client(tmp_path)
    (run,) = client.search_runs([client.get_experiment_by_name("bad").experiment_id])
    assert run.info.status == "FAILED"
    assert (tmp_path / "logs" / "temporary-prefect-server.log").is_file()
    assert temporary_servers_of(tmp_path) == []


def temporary_servers_of(home: Path) -> list[int]:
    """Processes running Prefect's API app with this state folder in their environment."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            command = (proc / "cmdline").read_bytes()
            environment = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"prefect.server.api.server:create_app" in command and f"ALIGNFLOW_HOME={home}".encode() in environment:
            found.append(int(proc.name))
    return found
