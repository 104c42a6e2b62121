"""MLflow tracking on the flow run's side: one parent run per flow run, one child run per stage,
the process that runs each, resumed stages. What needs no Prefect (the client, params, metrics,
dataset inputs) is :mod:`tasks.mlflow_runs`.
"""

from __future__ import annotations

import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Protocol
from uuid import UUID

import yaml
from mlflow.entities import RunStatus, RunTag
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST, ErrorCode
from prefect import get_run_logger
from prefect.artifacts import create_link_artifact
from prefect.client.orchestration import get_client
from prefect.runtime import flow_run
from prefect.settings import PREFECT_UI_URL

from infra.core.config import TrackingConfig
from infra.core.processes import process_record
from infra.core.reachability import require_tracking_server
from infra.core.settings import redact_url
from infra.core.stage_io import StageFolder
from tasks.mlflow_runs import client, experiment_id, log_params, mlflow_run_url


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=Path(__file__).parent
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def flow_run_url() -> str | None:
    """The Prefect UI page of the current flow run; None outside a run or without a known UI
    (the temporary local server has none)."""
    ui, run_id = PREFECT_UI_URL.value(), flow_run.get_id()
    return redact_url(f"{ui.rstrip('/')}/flow-runs/flow-run/{run_id}") if ui and run_id else None


class TrackedConfig(Protocol):
    """What :func:`start_parent_run` reads of a config section (an experiment's, a sweep's, an
    evaluation request's)."""

    @property
    def run_name(self) -> str: ...

    @property
    def tracking(self) -> TrackingConfig: ...

    def content_hash(self) -> str: ...

    def flat(self) -> dict[str, Any]: ...

    def model_dump(self, *, mode: str = ...) -> dict[str, Any]: ...


def start_parent_run(config: TrackedConfig, kind: str = "experiment", parent_run_id: str | None = None) -> str:
    """A parent run for a flow run of ``config`` (which has ``run_name`` and ``tracking``),
    nested under ``parent_run_id`` when given (a sweep's trial under the sweep's run). An unreachable
    tracking server fails it in seconds, before anything is created (:mod:`infra.core.reachability`)."""
    require_tracking_server()
    tags = {
        "alignflow.kind": kind,
        "alignflow.config_hash": config.content_hash(),
        "mlflow.source.git.commit": git_commit(),
        "prefect.flow_run_id": str(flow_run.get_id() or ""),
        "prefect.flow_run_name": str(flow_run.get_name() or ""),
        **process_record().tags(),
    }
    if url := flow_run_url():
        tags["prefect.flow_run_url"] = url
        # the run's description (markdown) in the MLflow UI: a link that can be clicked, unlike a tag
        tags["mlflow.note.content"] = f"[Prefect flow run {flow_run.get_name()}]({url})"
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
    run = client().create_run(experiment_id(config.tracking.experiment_name), run_name=config.run_name, tags=tags)
    log_params(run.info.run_id, config.flat())
    client().log_text(run.info.run_id, yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), "config.yaml")
    if flow_run.get_id():
        get_run_logger().info("MLflow run: %s", mlflow_run_url(run.info.experiment_id, run.info.run_id))
        create_link_artifact(
            key="mlflow-run",
            link=mlflow_run_url(run.info.experiment_id, run.info.run_id),
            link_text=f"MLflow run {run.info.run_name} ({run.info.run_id})",
            description=f"The MLflow parent run of this flow run (experiment {config.tracking.experiment_name!r}).",
        )
    return run.info.run_id


LABELLED_FLOW_RUNS: set[str] = set()  # flow runs this process has labelled already


def record_process(run_id: str) -> None:
    """Tag ``run_id`` (and label the current Prefect flow run, once) with this process's record, so
    that ``alignflow runs cleanup`` can tell a run whose process is gone from a live one. The label
    is best effort: an unreachable Prefect server must not fail the work (its flow run then has no
    record, and cleanup leaves it alone)."""
    tags = process_record().tags()
    client().log_batch(run_id, tags=[RunTag(key, value) for key, value in tags.items()])
    flow_run_id = flow_run.get_id()
    if flow_run_id is None or flow_run_id in LABELLED_FLOW_RUNS:
        return
    try:
        with get_client(sync_client=True) as prefect:
            prefect.update_flow_run_labels(UUID(flow_run_id), {**tags})  # as a dict of label values
        LABELLED_FLOW_RUNS.add(flow_run_id)
    except Exception as error:  # httpx / Prefect API errors: the server is down or refuses
        get_run_logger().warning("could not label flow run %s with its process: %s", flow_run_id, error)


@contextmanager
def tracked_run(run_id: str) -> Iterator[str]:
    """Mark ``run_id`` as run by this process, FINISHED when the block completes, FAILED when it raises."""
    try:
        record_process(run_id)
        yield run_id
    except BaseException as error:
        try:
            client().set_terminated(run_id, RunStatus.to_string(RunStatus.FAILED))
        except MlflowException as unreachable:  # the block's error is the one to report
            error.add_note(
                f"The MLflow run {run_id} could not be marked FAILED ({unreachable}); it stays RUNNING until "
                "`alignflow runs cleanup` (or the next `alignflow run`) finds its process gone."
            )
        raise
    client().set_terminated(run_id, RunStatus.to_string(RunStatus.FINISHED))


def stage_run_id(parent_run_id: str, stage: str, folder: StageFolder) -> str:
    """The stage's child run, created once and remembered in its output folder, so a retried or
    resumed stage logs into the same run (a remembered run the tracking store does not know, e.g.
    in a copied state folder pointed at another store, is replaced by a new one)."""
    if (run_id := folder.recorded_run_id()) is not None:
        try:
            client().update_run(run_id, status="RUNNING")
            return run_id
        except MlflowException as error:
            if error.error_code != ErrorCode.Name(RESOURCE_DOES_NOT_EXIST):
                raise
    parent = client().get_run(parent_run_id)
    run = client().create_run(
        parent.info.experiment_id,
        run_name=stage,
        tags={
            "mlflow.parentRunId": parent_run_id,
            "alignflow.stage": stage,
            **{k: v for k, v in parent.data.tags.items() if k.startswith(("prefect.", "alignflow.config"))},
        },
    )
    folder.path.mkdir(parents=True, exist_ok=True)
    folder.run_id_file.write_text(run.info.run_id)
    return run.info.run_id


def mark_resumed(run_id: str, parent_run_id: str, stage: str, from_step: int) -> None:
    """Tag a stage run that continues in a later attempt (a rerun or a Prefect retry): resumed, from
    which step, by which flow run and parent run; the parent names the flow run it continues."""
    continued = client().get_run(run_id).data.tags.get("prefect.flow_run_id", "")
    client().log_batch(
        run_id,
        tags=[
            RunTag("alignflow.resumed", "true"),
            RunTag("alignflow.resumed_from_step", str(from_step)),
            RunTag("alignflow.resumed_by_flow_run_id", str(flow_run.get_id() or "")),
            RunTag("alignflow.resumed_by_parent_run_id", parent_run_id),
        ],
    )
    client().set_tag(parent_run_id, f"alignflow.{stage}_continues_flow_run_id", continued)


def link_stage(parent_run_id: str, stage: str, model_run_id: str | None) -> None:
    """Record on the parent which run trained ``stage``'s model; for a cache hit that is an earlier run's."""
    if model_run_id is not None:
        client().set_tag(parent_run_id, f"alignflow.{stage}_run_id", model_run_id)
