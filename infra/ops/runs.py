"""``alignflow runs cleanup [--dry-run]``: runs left RUNNING by a process that is gone (killed, crashed,
machine rebooted) are marked FAILED in MLflow and CRASHED in Prefect, with the reason.

Every run carries the record of the process that runs it (:mod:`infra.core.processes`): MLflow runs as
``alignflow.process.*`` tags (a stage run without one is judged by its parent's), Prefect flow runs
as labels of the same names. Only runs of this host are judged; runs of other hosts are left alone
(their processes can only be checked there). The temporary Prefect server of a killed run (left
running, re-parented to init) is stopped. ``alignflow run`` does the same at its start.
"""

from __future__ import annotations

import argparse
import os
import signal
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, Iterator

from infra.core.prefect_compat import EPHEMERAL_MARK, runs_server_app
from infra.core.processes import ProcessRecord, all_pids, command_line, environment, is_alive, is_this_host, proc_stat

REASON_TAG = "alignflow.failure_reason"
PAGE = 200


def verdict(record: ProcessRecord | None) -> str:
    """``gone`` (its process no longer runs), ``alive``, ``other-host`` or ``unrecorded``."""
    if record is None:
        return "unrecorded"
    if not is_this_host(record):
        return "other-host"
    return "alive" if is_alive(record) else "gone"


def gone_reason(record: ProcessRecord) -> str:
    return f"process gone: {record} no longer runs (found by alignflow runs cleanup)"


@dataclass(frozen=True)
class Finding:
    """A RUNNING run and what its process record says."""

    kind: str  # "MLflow run" or "Prefect flow run"
    id: str
    name: str
    verdict: str
    record: ProcessRecord | None

    def describe(self) -> str:
        return f"{self.kind} {self.name} ({self.id})"

    def failure_reason(self) -> str:
        """:func:`gone_reason` of its record (a run judged ``gone`` has one)."""
        if self.record is None:
            raise ValueError(f"{self.describe()} has no process record: its process is not known to be gone")
        return gone_reason(self.record)


def running_mlflow_runs(client) -> Iterator:
    from mlflow.entities import ViewType

    experiment_ids = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ACTIVE_ONLY)]
    token = None
    while experiment_ids:
        page = client.search_runs(experiment_ids, "attributes.status = 'RUNNING'", max_results=PAGE, page_token=token)
        yield from page
        if not (token := page.token):
            return


def mlflow_findings(client) -> list[Finding]:
    """RUNNING MLflow runs, each judged by its own process record, else by its parent run's."""
    findings, parents = [], {}
    for run in running_mlflow_runs(client):
        record = ProcessRecord.from_tags(run.data.tags)
        if record is None and (parent_id := run.data.tags.get("mlflow.parentRunId")):
            if parent_id not in parents:
                parents[parent_id] = ProcessRecord.from_tags(client.get_run(parent_id).data.tags)
            record = parents[parent_id]
        findings.append(Finding("MLflow run", run.info.run_id, run.info.run_name, verdict(record), record))
    return findings


def fail_mlflow_run(client, finding: Finding) -> None:
    client.set_tag(finding.id, REASON_TAG, finding.failure_reason())
    client.set_terminated(finding.id, "FAILED")


def running_filter(filter_class, state_class, type_class):
    from prefect.client.schemas.objects import StateType

    return filter_class(state=state_class(type=type_class(any_=[StateType.RUNNING])))


def running_flow_runs(prefect) -> Iterator:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType

    offset = 0
    while page := prefect.read_flow_runs(
        flow_run_filter=running_filter(FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType),
        limit=PAGE,
        offset=offset,
    ):
        yield from page
        offset += len(page)


def prefect_findings(prefect) -> list[Finding]:
    findings = []
    for run in running_flow_runs(prefect):
        record = ProcessRecord.from_tags(dict(run.labels or {}))
        findings.append(Finding("Prefect flow run", str(run.id), run.name, verdict(record), record))
    return findings


def crash_flow_run(prefect, finding: Finding) -> int:
    """The flow run and its RUNNING task runs become CRASHED; the number of task runs crashed."""
    from uuid import UUID

    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        TaskRunFilter,
        TaskRunFilterState,
        TaskRunFilterStateType,
    )
    from prefect.states import Crashed

    reason = finding.failure_reason()
    task_runs = prefect.read_task_runs(
        flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[UUID(finding.id)])),
        task_run_filter=running_filter(TaskRunFilter, TaskRunFilterState, TaskRunFilterStateType),
    )
    for task_run in task_runs:
        prefect.set_task_run_state(task_run.id, Crashed(message=reason), force=True)
    prefect.update_flow_run_labels(UUID(finding.id), {REASON_TAG: reason})
    prefect.set_flow_run_state(UUID(finding.id), Crashed(message=reason), force=True)
    return len(task_runs)


def orphaned_temporary_servers(prefect_home: str) -> list[int]:
    """Temporary Prefect servers of this state folder whose ``alignflow`` process is gone: processes
    running Prefect's server app with ``PREFECT__SERVER_EPHEMERAL=1`` and this ``PREFECT_HOME`` in their
    environment, re-parented to init (Prefect's own temporary server outlives a killed process; the one
    alignflow starts gets a parent-death signal)."""
    wanted = {EPHEMERAL_MARK, f"PREFECT_HOME={prefect_home}".encode()}
    found = []
    for pid in all_pids() or []:
        if not runs_server_app(command_line(pid) or []):
            continue
        env = environment(pid)  # None: gone meanwhile, or another user's
        stat = proc_stat(pid)
        if env is not None and wanted <= env and stat is not None and stat.ppid == 1:
            found.append(pid)
    return sorted(found)


def stop_orphaned_servers(dry_run: bool, say: Callable[[str], None]) -> None:
    for pid in orphaned_temporary_servers(os.environ.get("PREFECT_HOME", "")):
        if not dry_run:
            os.kill(pid, signal.SIGTERM)
        say(f"{'would stop' if dry_run else 'stopped'} the temporary Prefect server of a killed run: pid {pid}")


def cleanup(
    dry_run: bool = False, say: Callable[[str], None] = print, quiet: bool = False, flow_runs: bool = True
) -> list[Finding]:
    """Judge every RUNNING MLflow run and (with ``flow_runs``) Prefect flow run; mark those whose
    process is gone (unless ``dry_run``). ``say`` gets a line per run marked (with ``quiet``: nothing
    else), per run left alone and a closing count. Returns the findings."""
    from mlflow import MlflowClient
    from prefect.client.orchestration import get_client

    from infra.core.settings import get_settings

    client = MlflowClient(get_settings().mlflow_tracking_uri)
    with get_client(sync_client=True) if flow_runs else nullcontext() as prefect:
        findings = [*mlflow_findings(client), *(prefect_findings(prefect) if flow_runs else [])]
        for finding in findings:
            if finding.verdict == "gone":
                state = "FAILED" if finding.kind == "MLflow run" else "CRASHED"
                extra = ""
                if not dry_run:
                    if finding.kind == "MLflow run":
                        fail_mlflow_run(client, finding)
                    else:
                        extra = f" with {crash_flow_run(prefect, finding)} running task run(s)"
                say(f"{'would mark' if dry_run else 'marked'} {state}: {finding.describe()}{extra}: {finding.record}")
            elif not quiet and finding.verdict in LEFT_ALONE:
                say(f"left alone: {finding.describe()}: {LEFT_ALONE[finding.verdict](finding.record)}")
    stop_orphaned_servers(dry_run, say)
    if not quiet:
        counts = {v: sum(f.verdict == v for f in findings) for v in ("gone", "alive", "other-host", "unrecorded")}
        say(
            f"{counts['gone']} run(s) whose process is gone{' (dry run: nothing changed)' if dry_run else ''}, "
            f"{counts['alive']} live, {counts['other-host']} of other hosts, {counts['unrecorded']} without a record"
        )
    return findings


LEFT_ALONE = {
    "other-host": lambda record: f"runs on host {record.host}; its process can only be checked there",
    "unrecorded": lambda record: "no process record (started before alignflow recorded one, or killed at once)",
}


def add_runs_parser(commands) -> None:
    runs = commands.add_parser("runs", help="maintain the state of runs", description=__doc__)
    actions = runs.add_subparsers(dest="action", required=True)
    clean = actions.add_parser(
        "cleanup", help="mark runs whose process is gone FAILED (MLflow) / CRASHED (Prefect)", description=__doc__
    )
    clean.add_argument("--dry-run", action="store_true", help="only print what would be marked")


def runs_command(args: argparse.Namespace) -> int:
    """A state folder with no Prefect database yet holds no flow run to judge: cleanup then starts no
    temporary Prefect server (it would only migrate a new database, about 10 s, to find nothing)."""
    from infra.core.settings import get_settings
    from infra.ops.databases import local_databases, prepare_databases

    settings = get_settings()
    prefect_database = local_databases(settings).get("prefect")  # None: on a Prefect server of its own
    fresh = prefect_database is not None and not prefect_database.exists()
    if fresh:
        print(f"no Prefect database yet ({prefect_database}): no flow runs to judge")
    prepare_databases(settings, temporary_prefect=prefect_database is not None and not fresh)
    cleanup(dry_run=args.dry_run, flow_runs=not fresh)
    return 0
