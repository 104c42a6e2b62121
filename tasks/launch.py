"""The parent side of a launched job (:data:`infra.core.stage_io.LaunchSpec`): write the spec, run
``accelerate launch`` of :mod:`tasks.launched_rank` over ``compute``'s processes with its output in
the task's logs, and collect rank 0's result, or raise the error of the rank that failed first.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
from pathlib import Path
from typing import Callable

from prefect import get_run_logger
from prefect.exceptions import MissingContextError
from pydantic import BaseModel

from infra.core.launching import Finished, run_process_group
from infra.core.stage_io import LaunchSpec, StageFolder, TrainInputs, TrainJob
from tasks.metric_sender import MetricsNotDelivered
from trainers.divergence import NonFiniteTraining
from trainers.launch import RankError

PROJECT_ROOT = Path(__file__).resolve().parents[1]
RANK_MODULE = "tasks.launched_rank"  # run as `-m` in every process
TRACEBACK_LINES = 25  # of the failed rank's traceback, in the task's error


class LaunchFailed(RuntimeError):
    """A launched job failed: the message holds the failed rank's traceback."""


# Errors a retry would only repeat: MLflow refusing the metrics, a diverged stage. A rank's is raised
# as its own type, so the train task does not retry it either. (A reward function that raised is
# retried: it may call a server that was away for a moment.)
REPEATING_ERRORS: dict[str, type[Exception]] = {
    error.__name__: error for error in (MetricsNotDelivered, NonFiniteTraining)
}


def failure(name: str, finished: Finished, launch_dir: Path) -> Exception:
    """The task's error for a launch that exited with ``finished.returncode``: the traceback of the
    rank that failed first (else the launch's last output lines); one of :data:`REPEATING_ERRORS` as itself."""
    first = RankError.first(launch_dir)
    if first is None:
        detail = "no rank reported an error; the launch's last output:\n" + "\n".join(finished.tail[-TRACEBACK_LINES:])
        return LaunchFailed(f"{name}: the launch exited with code {finished.returncode}; {detail}")
    lines = first.traceback.rstrip().splitlines()[-TRACEBACK_LINES:]
    message = f"{name}: rank {first.rank} failed ({first.error}):\n" + "\n".join(lines)
    return REPEATING_ERRORS.get(first.error, LaunchFailed)(message)


def run_log(line: str) -> None:
    """A launch's output line: into the task run's logs, or the ``alignflow`` logger outside a run
    (a script, a benchmark)."""
    try:
        logger = get_run_logger()
    except MissingContextError:
        logger = logging.getLogger("alignflow")
    logger.info(line)


def launch(spec: LaunchSpec, name: str, log: Callable[[str], None] = run_log) -> BaseModel:
    """Run ``spec`` over its ``compute``'s processes from its launch folder (emptied first), each output
    line to ``log``; rank 0's result, or the failed rank's error raised."""
    shutil.rmtree(spec.launch_dir, ignore_errors=True)
    spec.launch_dir.mkdir(parents=True)
    spec.spec_file.write_text(spec.model_dump_json(indent=2))
    compute = spec.compute
    command = compute.launch_command(spec.spec_file, RANK_MODULE)
    log(f"{name} on {compute.num_processes} processes: {shlex.join(command)}")
    for machine in range(1, compute.num_machines):
        other = compute.model_copy(update={"machine_rank": machine}).launch_command(spec.spec_file, RANK_MODULE)
        log(f"machine {machine} must run, from the same checkout: {shlex.join(other)}")
    # each line reaches the logs when it is printed; torch's launcher keeps a log folder per launch
    # in the temp folder and never removes it: it goes to the launch folder's, removed afterwards
    temporary = spec.launch_dir / "tmp"
    temporary.mkdir()
    env = os.environ | {"PYTHONUNBUFFERED": "1", "TMPDIR": str(temporary)}
    try:
        finished = run_process_group(command, log, cwd=PROJECT_ROOT, env=env)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    if finished.returncode != 0:
        raise failure(name, finished, spec.launch_dir)
    return spec.result.model_validate_json(spec.result_file.read_text())


def untracked_train_job(
    stage: str, section: dict, inputs: TrainInputs, folder: Path, plugins: tuple[str, ...] = ()
) -> TrainJob:
    """A stage trained from its start in ``folder`` (``model/``, ``launch/``), tracked nowhere: for a
    script or a benchmark that launches a stage outside the pipeline."""
    stage_folder = StageFolder(path=folder)
    return TrainJob(
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
