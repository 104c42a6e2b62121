"""The parent side of a launched job (:data:`infra.core.stage_io.LaunchSpec`): write the spec, place
the other machines' parts, run machine 0's (:mod:`tasks.machine`) with its output in the task's
logs, and collect rank 0's result, or raise the error of the rank that failed first.
"""

from __future__ import annotations

import logging
import shutil
import socket
from pathlib import Path
from typing import Callable, overload

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import MissingContextError
from pydantic import BaseModel

from infra.core.launching import Finished
from infra.core.stage_io import (
    EvaluateJob,
    EvaluateResult,
    LaunchSpec,
    ReferenceJob,
    ReferenceResult,
    StageFolder,
    TrainInputs,
    TrainJob,
    TrainResult,
    read_spec,
)
from tasks.machine import failure, gang_of, machine_command, run_machine, run_part
from tasks.metric_sender import MetricsNotDelivered
from tasks.placement import ByHand, OnDask
from trainers.runtime.non_finite import NonFiniteTraining

# Errors a retry would only repeat: MLflow refusing the metrics, a diverged stage. A rank's is raised
# as its own type, so the train task does not retry it either. (A reward function that raised is
# retried: it may call a server that was away for a moment.)
REPEATING_ERRORS: dict[str, type[Exception]] = {
    error.__name__: error for error in (MetricsNotDelivered, NonFiniteTraining)
}


def run_log(line: str) -> None:
    """A launch's output line: into the task run's logs, or the ``alignflow`` logger outside a run
    (a script, a benchmark)."""
    try:
        logger = get_run_logger()
    except MissingContextError:
        logger = logging.getLogger("alignflow")
    logger.info(line)


@overload
def launch(spec: TrainJob, name: str, log: Callable[[str], None] = ...) -> TrainResult: ...
@overload
def launch(spec: ReferenceJob, name: str, log: Callable[[str], None] = ...) -> ReferenceResult: ...
@overload
def launch(spec: EvaluateJob, name: str, log: Callable[[str], None] = ...) -> EvaluateResult: ...


def launch(spec: LaunchSpec, name: str, log: Callable[[str], None] = run_log) -> BaseModel:
    """Run ``spec`` over its ``compute``'s processes from its launch folder (emptied first), each output
    line to ``log``; rank 0's result, or the failed rank's error raised. With several machines this is
    machine 0's part: the others run :func:`tasks.machine.machine_command`, and the machines start and stop as one
    (:mod:`infra.core.gang`)."""
    compute = spec.compute
    others = range(1, compute.num_machines)
    placement: OnDask | ByHand | None = None
    if others:  # before anything is written: a part that no Dask worker can take fails the launch here
        placement = (
            OnDask(compute.machine_scheduler, name, log, machine_part_task, others)
            if compute.machine_scheduler
            else ByHand(name, log, machine_command)
        )
    try:
        shutil.rmtree(spec.launch_dir, ignore_errors=True)
        spec.launch_dir.mkdir(parents=True)
        spec.spec_file.write_text(spec.model_dump_json(indent=2))
        if placement is not None:
            for machine in others:
                placement.place(spec, machine)
        finished = run_machine(spec, 0, name, log, placement.lost if placement is not None else lambda: None)
    finally:
        if placement is not None:
            placement.release(gang_of(spec, 0).joined)
    if finished.returncode != 0:
        gang = gang_of(spec, 0) if compute.num_machines > 1 else None
        raise failure(name, finished, spec.launch_dir, gang, REPEATING_ERRORS)
    return spec.result.model_validate_json(spec.result_file.read_text())


def untracked_train_job(
    stage: str, section: dict, inputs: TrainInputs, folder: Path, plugins: tuple[str, ...] = ()
) -> TrainJob:
    """A stage trained from its start in ``folder`` (``model/``, ``launch/``), tracked nowhere: for a
    script or a benchmark that launches a stage outside the pipeline."""
    stage_folder = StageFolder(path=folder)
    return TrainJob.model_validate(  # validates `section` as the stage's
        dict(
            plugins=plugins,
            launch_dir=stage_folder.launch_dir,
            stage=stage,
            section=section,
            inputs=inputs,
            folder=stage_folder,
            model_dir=stage_folder.model_dir,
            run_id=None,
            log_checkpoints="none",
            checkpoint=None,
            final=False,
        )
    )


def launched_hosts(spec: LaunchSpec) -> list[str]:
    """The host each machine's part of ``spec``'s finished launch ran on, in machine order."""
    if spec.compute.num_machines == 1:
        return [socket.gethostname()]
    return gang_of(spec, 0).hosts()


def machine_part(spec_file: str, machine: int, name: str) -> Finished:
    """Machine ``machine``'s part of the launch ``name`` whose spec is ``spec_file``, where a placement
    runs it (``tasks.placement``): its output to the run's logs (or the ``alignflow`` logger); a join
    that fails, or a launch that exits non-zero, raises (:func:`tasks.machine.run_part`)."""
    return run_part(read_spec(Path(spec_file)), machine, name, run_log, REPEATING_ERRORS)


# The same part as a task run of the flow run whose stage placed it, with its own logs (a placement
# submits it from inside the flow run; outside one, the plain function). Its result is the
# placement's, handed back in memory: nothing to persist or cache.
machine_part_task = task(name="machine-part", persist_result=False, cache_policy=NO_CACHE, retries=0)(machine_part)
