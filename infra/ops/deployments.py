"""Deployments: ``prefect.yaml`` is the one list of them.

``alignflow deploy`` registers them on a Prefect server (creating their process work pools), for
workers to run; ``alignflow serve`` serves them, with their schedules, from one process. A
deployment's default parameters come from a config file in ``configs/`` through the
``config_parameters`` build step, so ``prefect deploy`` reads the same file the same way.
Entrypoints are module paths (``flows.pipeline.experiment``): a flow run imports its flow as the
package's module, so what it hands to another process (a Dask worker's task run) unpickles there;
a file entrypoint loads it as a script module (``pipeline``) no other process can import. Config
paths in a deployments file are relative to the project root.

``alignflow deploy`` runs ``prefect deploy`` itself. ``alignflow serve`` builds the deployments with
the public ``flow.to_deployment``; Prefect has no public API that reads a deployments file for
``prefect.serve``, so their parameters come from the build steps run as ``prefect deploy`` runs them
(:func:`infra.core.prefect_compat.run_build_steps`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Callable

import yaml
from pydantic import TypeAdapter

from infra.core.config import SCHEMAS, load_config
from infra.core.prefect_compat import apply_step_outputs, run_build_steps

PROJECT_ROOT = Path(__file__).resolve().parents[2]
PREFECT_FILE = PROJECT_ROOT / "prefect.yaml"
WORK_POOL_TYPE = "process"


def config_parameters(
    path: str, overrides: list[str] | None = None, schema: str = "ExperimentConfig", parameter: str = "config"
) -> dict[str, Any]:
    """prefect.yaml build step: ``{parameter: …}`` from a config file validated against ``schema``
    (a name in ``infra.core.config.SCHEMAS``)."""
    return {parameter: load_config(path, overrides or [], SCHEMAS[schema]).model_dump(mode="json")}


def load_prefect_file(path: Path = PREFECT_FILE) -> dict[str, Any]:
    return yaml.safe_load(path.read_text()) or {}


def select_deployments(
    project: dict[str, Any], names: list[str] | None, path: Path = PREFECT_FILE
) -> list[dict[str, Any]]:
    deployments = project.get("deployments") or []
    if not names:
        return deployments
    known = {entry["name"]: entry for entry in deployments}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"{path}: no deployment named {', '.join(unknown)} (known: {', '.join(known)})")
    return [known[name] for name in names]


def work_pools(deployments: list[dict[str, Any]]) -> list[str]:
    return sorted({entry["work_pool"]["name"] for entry in deployments if (entry.get("work_pool") or {}).get("name")})


def resolved_parameters(entry: dict[str, Any], project: dict[str, Any]) -> dict[str, Any]:
    """The deployment's parameters after its build steps ran, as ``prefect deploy`` resolves them."""
    outputs = run_build_steps(entry.get("build", project.get("build")) or [])
    return apply_step_outputs(entry.get("parameters") or {}, outputs)


def schedules(entry: dict[str, Any]) -> list:
    """prefect.yaml schedule entries (``cron``, ``interval`` in seconds or ISO 8601, ``rrule``) as Prefect schedules."""
    from prefect.schedules import Schedule

    converters: dict[str, Callable[[Any], Any]] = {  # on YAML values
        "interval": TypeAdapter(timedelta).validate_python,
        "anchor_date": TypeAdapter(datetime).validate_python,
    }
    return [
        Schedule(**{key: converters[key](value) if key in converters else value for key, value in spec.items()})
        for spec in entry.get("schedules") or []
    ]


def served_deployments(names: list[str] | None = None, path: Path = PREFECT_FILE) -> list:
    """``RunnerDeployment``s of prefect.yaml's deployments, for ``prefect.serve`` (run from the project root)."""
    from prefect.flows import Flow, load_flow_from_entrypoint
    from prefect.types.entrypoint import EntrypointType

    project = load_prefect_file(path)
    deployments = []
    for entry in select_deployments(project, names, path):
        flow: Flow[..., Any] = load_flow_from_entrypoint(entry["entrypoint"])
        deployments.append(
            flow.to_deployment(
                name=entry["name"],
                schedules=schedules(entry),
                parameters=resolved_parameters(entry, project),
                description=entry.get("description"),
                tags=entry.get("tags"),
                paused=entry.get("paused"),
                entrypoint_type=EntrypointType.MODULE_PATH,
            )
        )
    return deployments


def pooled_deployments(deployments: list) -> list[str]:
    """Those of ``deployments`` that the server already has on a work pool (``alignflow deploy``'s):
    serving one would replace its pull steps, and its workers' next runs would fail."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    taken = []
    with get_client(sync_client=True) as client:
        for deployment in deployments:
            name = f"{deployment.flow_name}/{deployment.name}"
            try:
                existing = client.read_deployment_by_name(name)
            except ObjectNotFound:
                continue
            if existing.work_pool_name:
                taken.append(f"{name} (work pool {existing.work_pool_name})")
    return taken


def ensure_work_pool(name: str) -> bool:
    """Create a process work pool with Prefect's default job template if it is missing; True if created."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(name)
            return False
        except ObjectNotFound:
            template = ProcessWorker.get_default_base_job_template()
            client.create_work_pool(WorkPoolCreate(name=name, type=WORK_POOL_TYPE, base_job_template=template))
            return True


def deploy(names: list[str] | None = None, path: Path = PREFECT_FILE) -> int:
    """Register the deployments with ``prefect deploy``, run from the project root (workers run the
    code from that folder: Prefect's default pull step)."""
    selected = select_deployments(load_prefect_file(path), names, path)
    for pool in work_pools(selected):
        if ensure_work_pool(pool):
            print(f"created work pool {pool!r} (type {WORK_POOL_TYPE})")
    which = [arg for name in names for arg in ("--name", name)] if names else ["--all"]
    command = [sys.executable, "-m", "prefect", "deploy", "--no-prompt", "--prefect-file", str(path), *which]
    return subprocess.run(command, cwd=PROJECT_ROOT, env=os.environ.copy()).returncode
