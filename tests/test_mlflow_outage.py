"""MLflow outages during training, with a real tracking server (SQLite backend, free loopback port)
that the test kills and starts again while a real SFT stage trains (the `train` task's function).

Training does not wait for the dead server: metrics are buffered and delivered once it is back;
a stage whose metrics cannot be delivered fails, it is never reported as a success."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
from helpers import NEEDS_AUTH_MLFLOW, state_folder_environment
from mlflow import MlflowClient
from prefect.logging import disable_run_logger

from infra.core.config import AdditionTaskConfig, DataConfig, ModelConfig, load_config
from infra.core.launching import ProcessGroup
from infra.core.ports import free_port
from infra.core.stage_io import TrainInputs
from infra.ops import servers
from tasks import trainer_callback
from tasks.data import prepare_dataset
from tasks.metric_sender import MetricSender, MetricsNotDelivered, backoff_seconds, store_sender
from tasks.mlflow_runs import metric_values
from tasks.models import resolve_model
from tasks.train import train
from tasks.trainer_callback import MlflowTrainerCallback

PROJECT_ROOT = Path(__file__).resolve().parents[1]
MAX_STEPS = 30
STOP_AT, RESTART_AT = 4, 12
STARTUP_TIMEOUT_S = 180
STALL_S = 5.0  # a step of the tiny model takes milliseconds; MLflow's own retries would take minutes


class TrackingServer:
    """`mlflow server` on SQLite in ``folder``, as `alignflow servers up` starts it (with ``credentials``:
    as `servers up --auth` does)."""

    def __init__(self, folder, credentials: servers.Credentials | None = None):
        self.folder = folder
        options = servers.ServerOptions(mlflow_port=free_port(), credentials=credentials)
        self.spec = servers.mlflow_server(options, folder)

    def start(self) -> None:
        servers.start(self.spec, self.folder)

    def wait_healthy(self) -> None:
        assert servers.wait_healthy({"mlflow": self.spec}, {"mlflow": self.folder}, STARTUP_TIMEOUT_S) == [], (
            servers.log_tail(self.folder)
        )

    def kill(self) -> None:
        """SIGKILL to the whole server: an outage, not a shutdown."""
        group = ProcessGroup(servers.read_pid(self.folder))
        assert group.signal(signal.SIGKILL)
        while group.alive():
            time.sleep(0.05)

    def ensure_up(self) -> None:
        if servers.read_pid(self.folder) is None:  # killed by a test before, and not started since
            self.start()
        self.wait_healthy()


@pytest.fixture(scope="module")
def tracking_server(tmp_path_factory):
    """One tracking server for the outage tests (starting one costs ~10 s): each ends with it up again."""
    server = TrackingServer(tmp_path_factory.mktemp("mlflow-server"))
    server.start()
    yield server
    servers.stop(server.folder, timeout=5)


@pytest.fixture
def server(tracking_server, monkeypatch):
    """The module's tracking server, up (started again should a test before have left it down)."""
    tracking_server.ensure_up()
    monkeypatch.setenv("ALIGNFLOW_TRACKING_URI", tracking_server.spec.url)
    return tracking_server


class OutageCallback(MlflowTrainerCallback):
    """The stage's own callback, plus the outage: kill the server after step ``STOP_AT``, start it
    again after ``restart_at`` (None: never), and note when each step ended and what was buffered."""

    def __init__(self, *args, server: TrackingServer, restart_at: int | None, notes: dict, **kwargs):
        super().__init__(*args, **kwargs)
        self.server, self.restart_at, self.notes = server, restart_at, notes
        notes.update(step_ends={}, pending={}, callback=self)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == STOP_AT:
            self.server.kill()
        if state.global_step == self.restart_at:
            self.server.start()  # it answers some seconds later: training goes on meanwhile
        self.notes["step_ends"][state.global_step] = time.monotonic()
        self.notes["pending"][state.global_step] = self.metrics.pending


@pytest.fixture(scope="module")
def inputs():
    """The built-in model and a small prepared addition dataset, as the flow's first two tasks make them."""
    with disable_run_logger():
        policy = resolve_model.fn(ModelConfig())
        data = prepare_dataset.fn(DataConfig(builtin=AdditionTaskConfig(max_operand=3, num_eval_problems=4)), policy)
    return TrainInputs(policy, data)


def train_through_outage(server, inputs, monkeypatch, name: str, restart_at: int | None, notes: dict) -> None:
    """Run the SFT stage with the outage; ``notes`` gets the parent run id and the callback's notes."""
    callback = partial(OutageCallback, server=server, restart_at=restart_at, notes=notes)
    # where the stage trainer imports it from, as it builds the trainer of a tracked run
    monkeypatch.setattr(trainer_callback, "MlflowTrainerCallback", callback)
    client = MlflowClient(server.spec.url)
    notes["parent"] = client.create_run(client.create_experiment(name), run_name=name).info.run_id
    overrides = [f"sft.max_steps={MAX_STEPS}", "sft.logging_steps=1", "sft.per_device_train_batch_size=4"]
    with disable_run_logger():
        config = load_config(None, [*overrides, "tracking.log_checkpoints=none"])
        train.fn("sft", config.sft, inputs, notes["parent"], name, config.tracking)


def stage_run(client: MlflowClient, parent: str):
    (run,) = client.search_runs([client.get_run(parent).info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent}'")
    return run


def slowest_step_during_outage(notes: dict) -> float:
    ends = notes["step_ends"]
    return max(ends[step] - ends[step - 1] for step in range(STOP_AT + 1, MAX_STEPS + 1))


@pytest.mark.slow
def test_training_goes_on_through_an_outage_and_every_metric_step_arrives_after_the_restart(
    server, inputs, monkeypatch
):
    monkeypatch.setenv("ALIGNFLOW_METRICS_FLUSH_TIMEOUT", str(STARTUP_TIMEOUT_S))
    notes: dict = {}
    train_through_outage(server, inputs, monkeypatch, "outage-then-back", RESTART_AT, notes)
    assert slowest_step_during_outage(notes) < STALL_S
    assert notes["pending"][RESTART_AT] >= RESTART_AT - STOP_AT  # the outage's metrics waited in the buffer
    assert notes["callback"].metrics.pending == 0
    client = MlflowClient(server.spec.url)
    run = stage_run(client, notes["parent"])
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == list(range(1, MAX_STEPS + 1))
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")] == [MAX_STEPS]


@pytest.mark.slow
def test_a_server_that_never_comes_back_fails_the_stage_and_it_is_not_finished(server, inputs, monkeypatch):
    monkeypatch.setenv("ALIGNFLOW_METRICS_FLUSH_TIMEOUT", "3")
    # the stage's other MLflow calls (marking the run FAILED) fail fast too, instead of retrying for minutes
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    notes: dict = {}
    started = time.monotonic()
    with pytest.raises(MetricsNotDelivered) as failure:
        train_through_outage(server, inputs, monkeypatch, "outage-for-good", None, notes)
    assert time.monotonic() - started < 120
    assert slowest_step_during_outage(notes) < STALL_S
    assert any("could not be marked FAILED" in note for note in failure.value.__notes__)
    server.start()
    server.wait_healthy()
    client = MlflowClient(server.spec.url)
    run = stage_run(client, notes["parent"])
    assert run.info.status == "RUNNING"  # not FINISHED: `alignflow runs cleanup` marks it once the process is gone
    delivered = [m.step for m in client.get_metric_history(run.info.run_id, "loss")]
    assert delivered == list(range(1, len(delivered) + 1)) and len(delivered) <= STOP_AT
    # a batch the server stored as it went down, whose answer was lost, counts as not delivered
    reported = re.search(
        rf"^MLflow run {run.info.run_id}: \d+ metric values \(steps (\d+)–{MAX_STEPS}\) "
        rf"not delivered to {re.escape(server.spec.url)} within 3 s: API request to ",
        str(failure.value),
    )
    assert reported and 1 <= int(reported[1]) <= len(delivered) + 1, str(failure.value)


@pytest.mark.unit
def test_backoff_doubles_from_half_a_second_up_to_its_cap():
    assert [backoff_seconds(n, cap=10.0) for n in range(1, 8)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


@pytest.mark.slow
def test_a_store_that_fails_twice_still_gets_every_metric_once():
    from tasks.mlflow_runs import client, experiment_id

    run_id = client().create_run(experiment_id("sender")).info.run_id
    deliver, calls = store_sender(client().tracking_uri), []

    def flaky(run, metrics):
        calls.append(len(metrics))
        if len(calls) <= 2:
            raise ConnectionError("no answer")
        deliver(run, metrics)

    sender = MetricSender(run_id, flaky, max_backoff=0.1)
    for step in range(1, 6):
        sender.submit(metric_values({"loss": 1.0 / step, "note": "text"}, step))
    sender.close(timeout=30)
    assert [(m.step, m.value) for m in client().get_metric_history(run_id, "loss")] == [
        (step, 1.0 / step) for step in range(1, 6)
    ]
    assert calls[2:] and sum(calls[2:]) == 5 and sender.failures == 0


@pytest.mark.slow
def test_metrics_the_store_rejects_are_reported_at_close():
    from tasks.mlflow_runs import client, experiment_id

    run_id = client().create_run(experiment_id("sender")).info.run_id
    client().delete_run(run_id)  # a deleted run takes no metrics: retrying cannot help
    sender = MetricSender.for_run(run_id, client().tracking_uri)
    sender.submit(metric_values({"loss": 1.0}, 7))
    with pytest.raises(MetricsNotDelivered, match=rf"^MLflow run {run_id}: 1 metric values \(step 7\) rejected: "):
        sender.close(timeout=30)


@pytest.fixture
def protected_server(tmp_path):
    """A tracking server that asks for a password (MLflow's basic-auth app)."""
    credentials = servers.Credentials.generate()
    server = TrackingServer(tmp_path / "mlflow-server", credentials)
    server.start()
    server.wait_healthy()
    yield server, credentials
    servers.stop(server.folder, timeout=5)


def files_holding(folder: Path, secret: str) -> list[str]:
    """Every file below ``folder`` whose bytes hold ``secret`` (databases and their write-ahead logs too)."""
    return [str(path) for path in sorted(folder.rglob("*")) if path.is_file() and secret.encode() in path.read_bytes()]


@pytest.mark.slow
@NEEDS_AUTH_MLFLOW
def test_alignflow_run_fails_with_one_clear_line_when_mlflow_dies_for_good_and_stores_no_password(
    protected_server, tmp_path
):
    """The outage path with a password in the tracking URI (and a run's own temporary Prefect
    server): the error line names the server without the password, and no output, no file of the
    state folder and no Prefect database holds it."""
    server, credentials = protected_server
    password = credentials.mlflow_password
    url = server.spec.url.replace("://", f"://{credentials.mlflow_username}:{password}@")
    home = tmp_path / "home"
    env = state_folder_environment(home, "ALIGNFLOW_") | {
        "MLFLOW_TRACKING_URI": url,
        "ALIGNFLOW_METRICS_FLUSH_TIMEOUT": "3",
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",  # the flow's own last calls (marking runs FAILED) fail fast
        "MLFLOW_HTTP_REQUEST_TIMEOUT": "5",
        "OMP_NUM_THREADS": "1",
    }
    command = [sys.executable, "-m", "infra.ops.cli", "run", "configs/minimal.yaml", "stages=[sft]"]
    command += ["sft.max_steps=200", "sft.logging_steps=1", "tracking.log_checkpoints=none"]
    log, out_log = tmp_path / "run.log", tmp_path / "run.out"
    with log.open("w") as out, out_log.open("w") as stdout:
        runner = subprocess.Popen(command, cwd=PROJECT_ROOT, env=env, stdout=stdout, stderr=out)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while "sft 4/200" not in log.read_text() and runner.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        server.kill()
        assert runner.wait(timeout=300) == 1, log.read_text()[-3000:]
    errors = [line for line in log.read_text().splitlines() if line.startswith("alignflow: ")]
    assert len(errors) == 1, log.read_text()[-3000:]
    assert re.match(  # the URI without its credentials, which MLflow sends from its own variables
        rf"alignflow: run [\w-]+: MetricsNotDelivered: MLflow run \w+: \d+ metric values \(steps \d+–200\) "
        rf"not delivered to {re.escape(server.spec.url)} within 3 s",
        errors[0],
    ), errors[0]
    assert (home / "prefect" / "prefect.db").is_file()  # the run's own temporary server: its database is here
    assert password not in log.read_text() + out_log.read_text()
    assert files_holding(home, password) == []
