"""The team setup with real processes: `alignflow servers up` (Prefect + MLflow on PostgreSQL),
`alignflow deploy`, a process worker, runs through the Prefect API and on an interval schedule,
both UIs in headless Chromium. One module-wide stack: each server takes 10-30 s to start."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg2
import pytest
import yaml
from helpers import environment_without_services
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    ArtifactFilterKey,
    DeploymentFilter,
    DeploymentFilterId,
)
from prefect.settings import PREFECT_API_URL, temporary_settings

from infra.core.config import load_config
from infra.core.launching import group_alive
from infra.core.ports import free_port
from infra.core.processes import all_pids, command_line, environment, proc_stat
from infra.ops.deployments import PREFECT_FILE, PROJECT_ROOT

pytestmark = pytest.mark.services

POSTGRES = "postgresql://postgres@127.0.0.1:5432"
SCREENSHOTS = PROJECT_ROOT / "test-artifacts" / "screenshots"
RUN_TIMEOUT_S = 300
# A scheduled run's config: the minimal data, two SFT steps, a few prompts: a flow run in seconds.
SCHEDULED_OVERRIDES = [
    "name=scheduled",
    "stages=[sft]",
    "sft.max_steps=2",
    "evaluation.num_prompts=4",
    "evaluation.num_samples=1",
    "tracking.experiment_name=scheduled",
]


def postgres(sql: str, params: tuple = ()) -> list[tuple]:
    connection = psycopg2.connect(f"{POSTGRES}/postgres")
    connection.autocommit = True
    try:
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            return cursor.fetchall() if cursor.description else []
    finally:
        connection.close()


def processes_with_env(key: str, value: str) -> list[int]:
    """Live processes whose environment has key=value (every process the stack started inherits it)."""
    needle = f"{key}={value}".encode()
    found = []
    for pid in all_pids() or []:
        stat = proc_stat(pid)
        if pid != os.getpid() and needle in (environment(pid) or set()) and stat is not None and not stat.zombie:
            found.append(pid)
    return found


def describe_process(pid: int) -> str:
    """A live process's pid, parent and command line, for an assertion's message."""
    stat, command = proc_stat(pid), command_line(pid)
    if stat is None or command is None:
        return f"{pid} (gone)"
    return f"{pid} (parent {stat.ppid}): {b' '.join(command).decode(errors='replace')[:300]}"


@dataclass
class Stack:
    home: Path
    env: dict[str, str]
    prefect_url: str
    mlflow_url: str
    databases: dict[str, str]
    up_output: str = ""
    nightly: Any = None  # the nightly deployment, as registered
    worker_log: Path | None = None

    def alignflow(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "infra.ops.cli", *args],
            env=self.env,
            cwd=PROJECT_ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    @contextmanager
    def prefect(self):
        with (
            temporary_settings(updates={PREFECT_API_URL: f"{self.prefect_url}/api"}),
            get_client(sync_client=True) as client,
        ):
            yield client

    def mlflow(self) -> MlflowClient:
        return MlflowClient(self.mlflow_url)


def write_deployments_file(path: Path) -> None:
    """The project's prefect.yaml plus a paused deployment on a 10 s interval (resumed by its test)."""
    project = yaml.safe_load(PREFECT_FILE.read_text())
    every_10s = {
        "name": "every-10s",
        "entrypoint": "flows.pipeline.experiment",
        "work_pool": {"name": "alignflow-process"},
        "paused": True,
        "build": [
            {
                "infra.ops.deployments.config_parameters": {
                    "id": "tiny",
                    "path": "configs/minimal.yaml",
                    "overrides": SCHEDULED_OVERRIDES,
                }
            }
        ],
        "parameters": {"config": "{{ tiny.config }}"},
        "schedules": [{"interval": 10}],
    }
    path.write_text(yaml.safe_dump({**project, "deployments": [*project["deployments"], every_10s]}, sort_keys=False))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    home = tmp_path_factory.mktemp("team-setup")
    suffix = uuid.uuid4().hex[:10]
    databases = {"prefect": f"alignflow_test_prefect_{suffix}", "mlflow": f"alignflow_test_mlflow_{suffix}"}
    ports = {"prefect": free_port(), "mlflow": free_port()}
    env = environment_without_services()
    (home / "user-home").mkdir()
    (home / "tmp").mkdir()
    env.update(
        HOME=str(home / "user-home"),  # what the commands leave outside ALIGNFLOW_HOME lands here, or in TMPDIR
        TMPDIR=str(home / "tmp"),
        ALIGNFLOW_HOME=str(home),
        PREFECT_API_URL=f"http://127.0.0.1:{ports['prefect']}/api",
        MLFLOW_TRACKING_URI=f"http://127.0.0.1:{ports['mlflow']}",
        MLFLOW_HTTP_REQUEST_MAX_RETRIES="2",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        # Fast loops, so scheduled runs are created and picked up within seconds.
        PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS="2",
        PREFECT_WORKER_QUERY_SECONDS="2",
        PREFECT_WORKER_PREFETCH_SECONDS="2",
    )
    stack = Stack(home, env, f"http://127.0.0.1:{ports['prefect']}", f"http://127.0.0.1:{ports['mlflow']}", databases)
    worker, worker_log = None, open(home / "worker.log", "wb")
    stack.worker_log = home / "worker.log"
    try:
        up = stack.alignflow(
            "servers",
            "up",
            # The browser walk-through below opens both UIs without logging in; test_server_auth.py runs the
            # authenticated default (servers, a tracked run, another local user refused).
            "--no-auth",
            "--prefect-port",
            str(ports["prefect"]),
            "--mlflow-port",
            str(ports["mlflow"]),
            "--prefect-database-url",
            f"{POSTGRES}/{databases['prefect']}",
            "--mlflow-database-url",
            f"{POSTGRES}/{databases['mlflow']}",
        )
        assert up.returncode == 0, up.stdout + up.stderr
        stack.up_output = up.stdout

        deployments_file = home / "prefect.yaml"
        write_deployments_file(deployments_file)
        deployed = stack.alignflow("deploy", "--prefect-file", str(deployments_file))
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        with stack.prefect() as client:
            # Nothing may start the nightly default experiment mid-test (should the test run at 02:00 UTC).
            stack.nightly = client.read_deployment_by_name("alignflow-experiment/nightly")
            client.pause_deployment(stack.nightly.id)

        worker = subprocess.Popen(
            [sys.executable, "-m", "infra.ops.cli", "worker", "--limit", "1"],
            env=env,
            cwd=home,
            stdout=worker_log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        yield stack
    finally:
        if worker is not None:
            os.killpg(worker.pid, 15)
            worker.wait(timeout=30)
            deadline = time.monotonic() + 20
            while group_alive(worker.pid) and time.monotonic() < deadline:
                time.sleep(0.2)
        worker_log.close()
        down = stack.alignflow("servers", "down", timeout=120)
        # Exits may trail `servers down`: with make test's vllm lane beside the tiers, one process of
        # the stack (not recorded which) outlived it by more than 30 s once. A slow exit is a warning
        # in the test report, naming the processes; one still alive after 90 s fails.
        started, warned = time.monotonic(), False
        while (left := processes_with_env("ALIGNFLOW_HOME", str(home))) and time.monotonic() < started + 90:
            if not warned and time.monotonic() > started + 30:
                slow = [describe_process(pid) for pid in left]
                warnings.warn(f"still exiting 30 s after `servers down`: {slow}", stacklevel=1)
                warned = True
            time.sleep(0.5)
        for name in databases.values():
            postgres(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        assert down.returncode == 0, down.stdout + down.stderr
        assert left == [], f"processes left behind: {[describe_process(pid) for pid in left]}"
        assert not postgres("SELECT datname FROM pg_database WHERE datname = ANY(%s)", (list(databases.values()),))


def wait_for_flow_runs(stack: Stack, deployment_id, count: int, timeout: float = RUN_TIMEOUT_S) -> list:
    """The deployment's first ``count`` flow runs once they are all final."""
    deadline = time.monotonic() + timeout
    while True:
        with stack.prefect() as client:
            runs = client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])),
                sort="EXPECTED_START_TIME_ASC",
            )
        final = [run for run in runs if run.state and run.state.is_final()]
        if len(final) >= count:
            return final[:count]
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{len(final)}/{count} final runs after {timeout} s: "
                f"{[(r.name, r.state_name) for r in runs]}\n{stack.worker_log.read_text()[-3000:]}"
            )
        time.sleep(2)


@pytest.fixture(scope="module")
def smoke_run(stack):
    """A run of configs/minimal.yaml (the `smoke` deployment's default parameters), triggered through the API."""
    with stack.prefect() as client:
        deployment = client.read_deployment_by_name("alignflow-experiment/smoke")
        flow_run = client.create_flow_run_from_deployment(deployment.id)
    (finished,) = wait_for_flow_runs(stack, deployment.id, 1)
    assert finished.id == flow_run.id
    assert finished.state.is_completed(), f"{finished.state}\n{stack.worker_log.read_text()[-3000:]}"
    mlflow = stack.mlflow()
    experiment = mlflow.get_experiment_by_name("alignflow-smoke")  # smoke runs stay out of the team's experiment
    (parent,) = mlflow.search_runs(
        [experiment.experiment_id],
        f"tags.`prefect.flow_run_id` = '{finished.id}' and tags.`mlflow.runName` = 'minimal'",
    )
    children = {
        run.info.run_name: run
        for run in mlflow.search_runs([experiment.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    }
    return deployment, finished, parent, children


def test_a_partial_config_through_the_api_keeps_the_deployments_other_defaults(stack, smoke_run):
    """Prefect merges parameters at the top level only: the flow merges a partial config onto the
    deployment's default config itself."""
    deployment = smoke_run[0]
    with stack.prefect() as client:
        partial = {"config": {"name": "partial", "dpo": {"beta": 0.25}}}
        flow_run = client.create_flow_run_from_deployment(deployment.id, parameters=partial)
    finished = next(run for run in wait_for_flow_runs(stack, deployment.id, 2) if run.id == flow_run.id)
    assert finished.state.is_completed(), f"{finished.state}\n{stack.worker_log.read_text()[-3000:]}"
    mlflow = stack.mlflow()
    (parent,) = mlflow.search_runs(
        [mlflow.get_experiment_by_name("alignflow-smoke").experiment_id],
        f"tags.`prefect.flow_run_id` = '{finished.id}' and tags.`alignflow.kind` = 'experiment'",
    )
    minimal = load_config("configs/minimal.yaml").flat()
    assert (parent.info.run_name, parent.data.params["dpo.beta"]) == ("partial", "0.25")
    for key in ("sft.max_steps", "dpo.max_steps", "grpo.num_generations", "data.builtin.max_operand"):
        assert parent.data.params[key] == str(minimal[key]), key


def test_servers_run_on_fresh_postgres_databases_and_report_healthy(stack):
    assert f"export PREFECT_API_URL={stack.prefect_url}/api" in stack.up_output
    assert f"export MLFLOW_TRACKING_URI={stack.mlflow_url}" in stack.up_output
    assert {
        f"prefect: created database {POSTGRES}/{stack.databases['prefect']}",
        f"mlflow: created database {POSTGRES}/{stack.databases['mlflow']}",
    } <= set(stack.up_output.splitlines())
    status = stack.alignflow("servers", "status")
    assert status.returncode == 0, status.stdout
    assert re.search(
        rf"prefect: running \(pid \d+\), healthy; url {stack.prefect_url}, database postgresql\+asyncpg://postgres@127.0.0.1:5432/{stack.databases['prefect']}",
        status.stdout,
    )
    assert re.search(
        rf"mlflow: running \(pid \d+\), healthy; url {stack.mlflow_url}, database postgresql\+psycopg2://",
        status.stdout,
    )
    for name in ("prefect", "mlflow"):
        folder = stack.home / "servers" / name
        assert int((folder / "pid").read_text()) > 0 and (folder / "server.log").stat().st_size > 0
    # Prefect's tables live in its PostgreSQL database.
    tables = psycopg2.connect(f"{POSTGRES}/{stack.databases['prefect']}")
    try:
        with tables.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM information_schema.tables WHERE "
                "table_name IN ('deployment', 'flow_run', 'work_pool')"
            )
            assert cursor.fetchone() == (3,)
    finally:
        tables.close()


def test_deploy_registers_prefect_yaml_with_config_defaults_on_a_process_pool(stack):
    with stack.prefect() as client:
        pool = client.read_work_pool("alignflow-process")
        nightly = client.read_deployment_by_name("alignflow-experiment/nightly")
        smoke = client.read_deployment_by_name("alignflow-experiment/smoke")
    assert pool.type == "process"
    assert nightly.work_pool_name == smoke.work_pool_name == "alignflow-process"
    assert nightly.parameters == {"config": load_config("configs/default.yaml").model_dump(mode="json")}
    smoke_config = load_config("configs/minimal.yaml", ["tracking.experiment_name=alignflow-smoke"])
    assert smoke.parameters == {"config": smoke_config.model_dump(mode="json")}
    (schedule,) = nightly.schedules
    assert (schedule.schedule.cron, schedule.schedule.timezone) == ("0 2 * * *", "UTC")
    assert smoke.schedules == []
    assert nightly.entrypoint == "flows.pipeline.experiment"
    assert nightly.pull_steps == [{"prefect.deployments.steps.set_working_directory": {"directory": str(PROJECT_ROOT)}}]
    # The form's schema: sections in declaration order, titled.
    sections = nightly.parameter_openapi_schema["definitions"]["ExperimentConfig"]["properties"]
    assert [name for name, _ in sorted(sections.items(), key=lambda item: item[1]["position"])] == [
        "name",
        "stages",
        "plugins",
        "seed",
        "model",
        "peft",
        "data",
        "reference",
        "evaluation",
        "compute",
        "tracking",
        "promotion",
        "sft",
        "dpo",
        "grpo",
        "kto",
        "reward",
        "distill",
    ]
    assert sections["dpo"]["title"] == "DPO" and sections["evaluation"]["title"] == "Evaluation"


def test_a_run_triggered_through_the_api_is_tracked_in_the_postgres_backed_mlflow(stack, smoke_run):
    deployment, flow_run, parent, children = smoke_run
    assert flow_run.work_pool_name == "alignflow-process" and flow_run.infrastructure_pid
    assert parent.info.status == "FINISHED" and set(children) == {"sft", "dpo", "grpo", "evaluate"}
    minimal = load_config("configs/minimal.yaml", ["tracking.experiment_name=alignflow-smoke"])
    assert parent.data.params["sft.max_steps"] == "6" and parent.data.params["data.builtin.max_operand"] == "9"
    assert parent.data.params == {key: str(value) for key, value in minimal.flat().items()}
    assert {f"eval/{stage}/greedy_accuracy" for stage in ("base", "sft", "dpo", "grpo")} <= set(parent.data.metrics)
    mlflow = stack.mlflow()
    dpo = children["dpo"].info.run_id
    assert [m.step for m in mlflow.get_metric_history(children["sft"].info.run_id, "loss")] == [2, 4, 6]
    assert len(mlflow.get_metric_history(dpo, "rewards/accuracies")) >= 2
    model_files = {artifact.path for artifact in mlflow.list_artifacts(dpo, "model")}
    assert {"model/config.json", "model/model.safetensors", "model/tokenizer.json"} <= model_files
    # The tracking server keeps them in its PostgreSQL database.
    rows = psycopg2.connect(f"{POSTGRES}/{stack.databases['mlflow']}")
    try:
        with rows.cursor() as cursor:
            cursor.execute("SELECT value FROM params WHERE run_uuid = %s AND key = 'dpo.beta'", (parent.info.run_id,))
            assert cursor.fetchall() == [("0.5",)]
            cursor.execute(
                "SELECT count(*) FROM runs WHERE run_uuid = ANY(%s)", ([run.info.run_id for run in children.values()],)
            )
            assert cursor.fetchone() == (len(children),)
    finally:
        rows.close()


def test_flow_run_and_mlflow_run_link_to_each_other(stack, smoke_run):
    deployment, flow_run, parent, children = smoke_run
    assert parent.data.tags["prefect.flow_run_url"] == f"{stack.prefect_url}/flow-runs/flow-run/{flow_run.id}"
    assert children["dpo"].data.tags["prefect.flow_run_url"] == parent.data.tags["prefect.flow_run_url"]
    with stack.prefect() as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id]))
        )
    (link,) = [artifact for artifact in artifacts if artifact.key == "mlflow-run"]
    run_url = (
        f"{stack.mlflow_url}/#/experiments/{parent.info.experiment_id}/runs/{parent.info.run_id}"
        "?workflowType=machine_learning"
    )
    assert link.data == f"[MLflow run minimal ({parent.info.run_id})]({run_url})"


def test_an_interval_schedule_produces_runs_that_the_worker_executes(stack, smoke_run):
    with stack.prefect() as client:
        deployment = client.read_deployment_by_name("alignflow-experiment/every-10s")
        assert deployment.paused and [s.schedule.interval.total_seconds() for s in deployment.schedules] == [10.0]
        client.resume_deployment(deployment.id)
    try:
        runs = wait_for_flow_runs(stack, deployment.id, 2)
    finally:
        with stack.prefect() as client:
            client.pause_deployment(deployment.id)
    assert all(run.auto_scheduled and run.state.is_completed() for run in runs), [(run.name, run.state) for run in runs]
    assert all(run.work_pool_name == "alignflow-process" and run.infrastructure_pid for run in runs)
    gap = (runs[1].expected_start_time - runs[0].expected_start_time).total_seconds()
    assert gap > 0 and gap % 10 == 0
    mlflow = stack.mlflow()
    experiment = mlflow.get_experiment_by_name("scheduled")
    for run in runs:
        (tracked,) = mlflow.search_runs(
            [experiment.experiment_id],
            f"tags.`prefect.flow_run_id` = '{run.id}' and tags.`mlflow.runName` = 'scheduled'",
        )
        assert tracked.info.status == "FINISHED" and "eval/base/greedy_accuracy" in tracked.data.metrics


CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]


def test_browser_shows_the_run_form_and_the_mlflow_metrics(stack, smoke_run):
    from playwright.sync_api import sync_playwright

    deployment, flow_run, parent, children = smoke_run
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    print(f"screenshots: {SCREENSHOTS}")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path="/usr/bin/chromium", headless=True, args=CHROMIUM_ARGS
        )  # a fresh profile each launch
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{stack.prefect_url}/deployments/deployment/{stack.nightly.id}")
            page.get_by_text("At 02:00 AM every day").first.wait_for(timeout=60_000)
            page.get_by_text("alignflow-process").first.wait_for(timeout=60_000)
            page.get_by_text("Parameters", exact=True).first.click()  # the tab
            page.get_by_text("builtin:tiny-llama").first.wait_for(timeout=60_000)
            page.screenshot(path=SCREENSHOTS / "prefect-deployment-parameters.png")

            page.goto(f"{stack.prefect_url}/deployments/deployment/{stack.nightly.id}/run")
            beta = page.get_by_text("β: scale of the log-ratios").first
            beta.wait_for(timeout=60_000)
            form = page.inner_text("body")
            labels = [
                "Name (Optional)",
                "Model (Optional)",
                "Data (Optional)",
                "Evaluation (Optional)",
                "Tracking (Optional)",
                "SFT (Optional)",
                "DPO (Optional)",
            ]
            positions = [0]  # each label after the one before (data's splits have stage titles too)
            for label in labels:
                positions.append(form.find(label, positions[-1]))
            assert -1 not in positions, dict(zip(labels, positions[1:]))
            for field in (
                "Learning Rate (Optional)",
                "Lr Scheduler Type (Optional)",
                "Reference (Optional)",
                "Max Operand (Optional)",
            ):
                assert field in form
            # Enums render as selects: dpo.reference, both lr_scheduler_types, data.truncation_mode.
            assert {"cached", "cosine", "constant", "keep_end"} <= set(
                page.locator(".p-select-button__value").all_inner_texts()
            )
            page.screenshot(path=SCREENSHOTS / "prefect-run-form.png")
            beta.scroll_into_view_if_needed()
            page.screenshot(path=SCREENSHOTS / "prefect-run-form-dpo.png")

            page.set_viewport_size({"width": 1400, "height": 1400})
            with stack.prefect() as client:  # the link this flow run stored to its MLflow run
                (link,) = [
                    artifact
                    for artifact in client.read_artifacts(
                        artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id]))
                    )
                    if artifact.key == "mlflow-run"
                ]
            page.goto(re.search(r"\((http[^)]+)\)", link.data).group(1))
            metric = page.get_by_text("eval/dpo/sampled_accuracy").first
            metric.wait_for(timeout=60_000)
            text = page.inner_text("body")
            assert "minimal" in text and "eval/sft/greedy_accuracy" in text and parent.info.run_id in text
            prefect_link = page.get_by_role("link", name=f"Prefect flow run {flow_run.name}")
            assert prefect_link.get_attribute("href") == parent.data.tags["prefect.flow_run_url"]  # clickable
            metric.scroll_into_view_if_needed()
            page.screenshot(path=SCREENSHOTS / "mlflow-run.png")

            # The experiment, as the README links it: the runs view (a table of runs), not GenAI's traces.
            page.goto(f"{stack.mlflow_url}/#/experiments/{parent.info.experiment_id}?workflowType=machine_learning")
            page.get_by_text("minimal").first.wait_for(timeout=60_000)
            assert "Run Name" in page.inner_text("body")  # the runs table
            page.screenshot(path=SCREENSHOTS / "mlflow-experiment.png")

            # A comparison of the smoke experiment's runs, as its Prefect artifact shows it.
            compared = stack.alignflow("compare", "--experiment", "alignflow-smoke")
            assert compared.returncode == 0, compared.stdout + compared.stderr
            with stack.prefect() as client:
                (comparison,) = client.read_artifacts(
                    artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["comparison"]))
                )
            page.goto(f"{stack.prefect_url}/artifacts/artifact/{comparison.id}")
            page.get_by_text("alignflow-smoke:").first.wait_for(timeout=60_000)
            body = page.inner_text("body")
            assert "baseline" in body and "comparison" in body
            page.screenshot(path=SCREENSHOTS / "prefect-comparison.png")
        finally:
            browser.close()
    shots = (
        "prefect-deployment-parameters.png",
        "prefect-run-form.png",
        "prefect-run-form-dpo.png",
        "mlflow-run.png",
        "mlflow-experiment.png",
        "prefect-comparison.png",
    )
    assert all((SCREENSHOTS / name).stat().st_size > 10_000 for name in shots)


def test_the_commands_leave_nothing_outside_the_state_folder(stack, smoke_run):
    """`servers up`, `deploy`, `worker` and the flow runs it started wrote nothing to HOME or TMPDIR
    (they are folders of this test) once no flow run is in flight (a running one has a workspace
    in TMPDIR, removed when it ends): everything lives under ALIGNFLOW_HOME."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while True:
        with stack.prefect() as client:
            in_flight = [
                run
                for run in client.read_flow_runs()
                if run.state and (run.state.is_running() or run.state.is_pending())
            ]
        outside = [p for name in ("user-home", "tmp") for p in (stack.home / name).rglob("*")]
        if (not in_flight and not outside) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert outside == []
