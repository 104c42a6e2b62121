"""Deployments from prefect.yaml, server specs and process control, UI form hints: no servers needed."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
from datetime import timedelta

import pytest
from helpers import ALIGNFLOW, environment_without_services
from pydantic import ValidationError

from infra.core import reachability
from infra.core.config import EvaluationRequest, ExperimentConfig, load_config
from infra.core.launching import group_alive
from infra.core.processes import pid_alive, process_record
from infra.core.settings import redact_url
from infra.ops import servers
from infra.ops.cli import main
from infra.ops.deployments import PROJECT_ROOT, config_parameters, schedules, select_deployments, served_deployments
from tasks.tracking import flow_run_url
from trainers.dpo.section import DPOStageConfig


@pytest.mark.unit
def test_config_parameters_build_step_loads_and_validates_a_config_file():
    assert config_parameters("configs/minimal.yaml") == {
        "config": load_config("configs/minimal.yaml").model_dump(mode="json")
    }
    tiny = config_parameters("configs/minimal.yaml", ["stages=[sft]", "dpo.beta=0.25"])["config"]
    assert tiny["stages"] == ["sft"] and tiny["dpo"]["beta"] == 0.25 and tiny["name"] == "minimal"
    with pytest.raises(ValidationError, match="dpo.beta"):
        config_parameters("configs/minimal.yaml", ["dpo.beta=-1"])


@pytest.mark.flow
def test_served_deployments_mirror_prefect_yaml(prefect_api_url):  # build steps resolve templates through the API
    nightly, smoke, evaluate, compare = served_deployments()
    assert (nightly.name, smoke.name, evaluate.name, compare.name) == (
        "nightly",
        "smoke",
        "evaluate-champion",
        "compare-daily",
    )
    assert evaluate.parameters == {
        "request": load_config(PROJECT_ROOT / "configs/evaluate.yaml", [], EvaluationRequest).model_dump(mode="json")
    }
    assert compare.parameters == {"experiment": "alignflow"}
    assert compare.schedules[0].schedule.cron == "0 6 * * *"
    assert nightly.entrypoint == smoke.entrypoint == "flows.pipeline.experiment"
    assert nightly.parameters == {"config": load_config(PROJECT_ROOT / "configs/default.yaml").model_dump(mode="json")}
    smoke_config = load_config(PROJECT_ROOT / "configs/minimal.yaml", ["tracking.experiment_name=alignflow-smoke"])
    assert smoke.parameters == {"config": smoke_config.model_dump(mode="json")}
    (schedule,) = nightly.schedules
    assert (schedule.schedule.cron, schedule.schedule.timezone, schedule.active) == ("0 2 * * *", "UTC", True)
    assert smoke.schedules == []
    assert nightly.tags == ["alignflow", "experiment"]


@pytest.mark.unit
def test_schedules_accept_seconds_iso_durations_and_cron():
    parsed = schedules(
        {
            "schedules": [
                {"interval": 90},
                {"interval": "PT10S", "active": False},
                {"cron": "*/5 * * * *", "timezone": "Europe/Berlin"},
            ]
        }
    )
    assert [s.interval for s in parsed[:2]] == [timedelta(seconds=90), timedelta(seconds=10)]
    assert parsed[1].active is False
    assert (parsed[2].cron, parsed[2].timezone) == ("*/5 * * * *", "Europe/Berlin")


@pytest.mark.unit
def test_an_unknown_deployment_name_is_a_clear_error():
    with pytest.raises(ValueError, match=r"no deployment named weekly \(known: nightly, smoke\)"):
        select_deployments({"deployments": [{"name": "nightly"}, {"name": "smoke"}]}, ["weekly"])


@pytest.mark.unit
def test_form_hints_keep_declaration_order_and_title_sections():
    schema = ExperimentConfig.model_json_schema()
    top = schema["properties"]
    assert [top[name]["position"] for name in ExperimentConfig.model_fields] == list(
        range(len(ExperimentConfig.model_fields))
    )
    assert [top[name]["title"] for name in ("model", "sft", "dpo", "evaluation")] == [
        "Model",
        "SFT",
        "DPO",
        "Evaluation",
    ]
    data = schema["$defs"]["DataConfig"]["properties"]
    assert (data["sft"]["title"], data["preference_eval"]["title"], data["max_length"]["title"]) == (
        "SFT",
        "Preference eval",
        "Max Length",
    )
    dpo = schema["$defs"]["DPOStageConfig"]["properties"]
    assert sorted(dpo, key=lambda name: dpo[name]["position"]) == list(DPOStageConfig.model_fields)


@pytest.mark.unit
def test_server_specs_default_to_sqlite_and_take_postgres_urls_with_their_drivers(tmp_path):
    prefect = servers.prefect_server(servers.ServerOptions(), tmp_path)
    assert prefect.env["PREFECT_API_DATABASE_CONNECTION_URL"] == f"sqlite+aiosqlite:///{tmp_path / 'prefect.db'}"
    assert prefect.exports == {"PREFECT_API_URL": "http://127.0.0.1:4200/api"}
    assert prefect.health_url == "http://127.0.0.1:4200/api/health"
    mlflow = servers.mlflow_server(servers.ServerOptions(mlflow_port=5555), tmp_path)
    assert mlflow.env["MLFLOW_BACKEND_STORE_URI"] == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert mlflow.command[mlflow.command.index("--artifacts-destination") + 1] == str(tmp_path / "artifacts")
    assert mlflow.exports == {"MLFLOW_TRACKING_URI": "http://127.0.0.1:5555"}

    options = servers.ServerOptions(
        prefect_database_url="postgresql://u:secret@db:5432/prefect",
        mlflow_database_url="postgresql://u:secret@db/mlflow",
    )
    assert servers.prefect_server(options, tmp_path).database_url == "postgresql+asyncpg://u:secret@db:5432/prefect"
    with_password = servers.mlflow_server(options, tmp_path)
    assert with_password.database_url == "postgresql+psycopg2://u:secret@db/mlflow"
    # the password travels in the server's environment (its user only), never on its command line (every user)
    assert with_password.env["MLFLOW_BACKEND_STORE_URI"] == "postgresql+psycopg2://u:secret@db/mlflow"
    assert not any("secret" in part for part in with_password.command)
    assert (
        servers.with_driver("postgresql+psycopg://u@db/x", "psycopg2") == "postgresql+psycopg://u@db/x"
    )  # an explicit driver stays
    assert redact_url("postgresql+asyncpg://u:secret@db:5432/prefect") == "postgresql+asyncpg://u:***@db:5432/prefect"


@pytest.mark.unit
def test_a_wildcard_bind_is_advertised_by_name_and_mlflow_allows_that_name(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_SERVER_ALLOWED_HOSTS", raising=False)
    options = servers.ServerOptions(host="0.0.0.0")
    name = socket.getfqdn()
    prefect, mlflow = servers.prefect_server(options, tmp_path), servers.mlflow_server(options, tmp_path)
    assert (
        prefect.exports == {"PREFECT_API_URL": f"http://{name}:4200/api"}
        and prefect.env["PREFECT_UI_API_URL"] == f"http://{name}:4200/api"
    )
    assert prefect.health_url == "http://127.0.0.1:4200/api/health"
    allowed = mlflow.command[mlflow.command.index("--allowed-hosts") + 1].split(",")
    assert {name, f"{name}:*", "localhost", "10.*", "192.168.*"} <= set(allowed)


def sleeper(name: str) -> servers.ServerSpec:
    """A stand-in server: a shell with a background grandchild, both in the group `start` creates."""
    return servers.ServerSpec(name, "", "http://127.0.0.1:9/none", ["sh", "-c", "sleep 300 & sleep 300"], {}, {}, "")


@pytest.mark.slow
def test_stop_ends_the_whole_process_group_and_forgets_the_pid(tmp_path):
    pid = servers.start(sleeper("sleeper"), tmp_path)
    assert servers.read_pid(tmp_path) == pid and pid_alive(pid)
    assert os.getpgid(pid) == pid  # its own group, apart from ours
    assert servers.stop(tmp_path, timeout=5)
    assert not group_alive(pid)
    assert servers.read_pid(tmp_path) is None and not servers.stop(tmp_path)


@pytest.mark.slow
def test_a_stale_pid_file_naming_another_process_is_never_signalled(tmp_path):
    """The server is long gone and the system gave its pid to an unrelated process: not the server."""
    stranger = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        record = process_record(stranger.pid)
        (tmp_path / "pid").write_text(str(stranger.pid))
        stale = dataclasses.replace(record, start_ticks=record.start_ticks - 1)  # the server's start, not this one's
        (tmp_path / servers.PROCESS_FILE).write_text(json.dumps(stale.tags()))
        assert servers.read_pid(tmp_path) is None and not servers.server_status("mlflow", tmp_path).running
        assert not servers.stop(tmp_path, timeout=5)
        assert stranger.poll() is None  # alive: never signalled
        assert not (tmp_path / "pid").exists() and not (tmp_path / servers.PROCESS_FILE).exists()
    finally:
        stranger.kill()
        stranger.wait()


@pytest.mark.slow
def test_wait_healthy_gives_up_at_once_on_a_server_that_died(tmp_path):
    spec = servers.ServerSpec(
        "dies", "", "http://127.0.0.1:9/none", ["sh", "-c", "echo cannot bind; exit 3"], {}, {}, ""
    )
    servers.start(spec, tmp_path)
    assert servers.wait_healthy({"dies": spec}, {"dies": tmp_path}, timeout=60) == ["dies"]
    assert "cannot bind" in servers.log_tail(tmp_path)


@pytest.mark.unit
def test_servers_status_of_nothing_started_is_stopped_with_exit_3(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ALIGNFLOW_HOME", str(tmp_path))
    assert main(["servers", "status"]) == 3
    assert capsys.readouterr().out == "prefect: stopped\nmlflow: stopped\n"
    with pytest.raises(SystemExit, match="unknown server redis"):
        main(["servers", "status", "redis"])


@pytest.mark.unit
@pytest.mark.parametrize("flags", [[], ["--auth"]])
def test_servers_up_authenticates_by_default_and_refuses_an_mlflow_that_reads_the_admin_from_its_file_only(
    flags, tmp_path, monkeypatch, capsys
):
    """MLflow 3.9-3.16 would not start on alignflow's settings file (no admin password in it), and on
    their own they create MLflow's default admin: nothing is started or written. `servers up` asks
    for it without --auth: authentication is the default."""
    from infra.core import mlflow_compat

    monkeypatch.setenv("ALIGNFLOW_HOME", str(tmp_path / "state"))
    monkeypatch.setattr(mlflow_compat, "installed_version", lambda: "3.16.0")
    assert main(["servers", "up", *flags, "--prefect-port", "1", "--mlflow-port", "1"]) == 2
    error = capsys.readouterr().err
    assert "authentication (the default) needs MLflow 3.17 or later, this is MLflow 3.16.0" in error
    assert "pip install 'mlflow[auth]>=3.17,<3.18'), or serve without authentication (--no-auth)\n" in error
    assert not (tmp_path / "state").exists()  # no credentials, no server folder, no state folder


@pytest.mark.slow
def test_deploy_without_a_prefect_server_says_how_to_get_one(tmp_path):
    result = subprocess.run(
        [*ALIGNFLOW, "deploy"],
        env=environment_without_services() | {"PREFECT_HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "this needs a Prefect server: set PREFECT_API_URL" in result.stderr


@pytest.mark.unit
def test_no_flow_run_url_outside_a_flow_run():
    assert flow_run_url() is None


# A process that ignores SIGTERM for a while, in a group with a child, like a slow worker and its flow runs.
STUBBORN = (
    "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, lambda *a: None); "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
    "print('ready', flush=True); time.sleep(60)"
)


@pytest.mark.slow
def test_a_group_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path):
    """`alignflow worker` runs the worker this way: SIGTERM reaches the whole group, and whatever is
    left after --grace seconds is killed; the command returns 0."""
    probe = (
        "import sys; from infra.ops import servers; "
        f"sys.exit(servers.run_in_group([sys.executable, '-c', {STUBBORN!r}], grace=1.0))"
    )
    runner = subprocess.Popen([sys.executable, "-c", probe], cwd=PROJECT_ROOT, stdout=subprocess.PIPE, text=True)
    assert runner.stdout.readline().strip() == "ready"
    (group,) = map(int, open(f"/proc/{runner.pid}/task/{runner.pid}/children").read().split())  # its own group
    assert os.getpgid(group) == group and group_alive(group)
    runner.send_signal(signal.SIGTERM)
    assert runner.wait(timeout=15) == 0
    assert not group_alive(group)


@pytest.mark.flow
def test_serve_refuses_names_that_workers_own(prefect_api_url, capsys):
    """`alignflow serve` would replace the pull steps of a deployment that `alignflow deploy` made
    for a work pool; its workers' next runs would then fail. It refuses, naming the deployment."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name="serve-test-pool", type="process"))
        flow_id = client.create_flow_from_name("alignflow-experiment")
        deployment_id = client.create_deployment(flow_id=flow_id, name="nightly", work_pool_name="serve-test-pool")
    try:  # nightly: smoke is the session's served deployment (served_smoke), which this one would replace
        assert main(["serve", "--name", "nightly"]) == 2
        assert "alignflow-experiment/nightly (work pool serve-test-pool) already deployed for workers" in (
            capsys.readouterr().err
        )
    finally:
        with get_client(sync_client=True) as client:
            client.delete_deployment(deployment_id)
            client.delete_work_pool("serve-test-pool")


@pytest.mark.unit
def test_a_tracking_server_that_answers_is_reachable_whatever_it_answers():
    import http.server
    import threading

    class Refusing(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # an authenticating server: 401 to a request without credentials
            self.send_response(401 if self.path == "/prefix/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        assert reachability.unreachable(f"http://bob:pw@127.0.0.1:{port}/prefix/") is None
        assert reachability.unreachable("sqlite:////nowhere/mlflow.db") is None  # a local store: nothing to reach
    finally:
        server.shutdown()
        server.server_close()
    assert "refused" in reachability.unreachable(f"http://127.0.0.1:{port}")
