"""Run a callable as the body of a process that ``accelerate launch`` started: the generic half of
a launched job, in the shape of ZenML's ``run_with_accelerate`` (the job itself, its typed spec and
the module each rank runs are ``infra.core.stage_io`` and ``tasks.launched_rank``).

:func:`run_as_launched_process` runs the job, writes the rank's error report when it raises (the
parent shows the first failed rank's traceback), destroys the process group and ends the process
without interpreter teardown (:mod:`trainers.runtime.fast_exit`). :func:`check_world_size` makes a launch
that silently ran fewer processes than asked fail (``accelerate launch --cpu --num_processes 2`` starts one).
"""

from __future__ import annotations

import json
import os
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from trainers.runtime.fast_exit import end_at_exit_without_teardown


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    """How many processes the launch started, as torch's launcher tells each (none told: one)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_world_size(expected: int) -> None:
    """Before the job imports and builds anything: a wrong launch fails in a second, not after the model loads."""
    started = world_size()
    if started != expected:
        raise SystemExit(
            f"trainers.runtime.launched_process: the spec asks for {expected} processes, this run has {started}: "
            "check the launch command (`--cpu --num_processes N` starts one process)"
        )


@dataclass(frozen=True)
class RankError:
    """What a failed rank reports, as ``error-rank-<rank>.json`` in its error folder."""

    rank: int
    time: float
    error: str  # the exception's class name
    traceback: str

    @staticmethod
    def path(folder: Path, rank: int) -> Path:
        return folder / f"error-rank-{rank}.json"

    @classmethod
    def first(cls, folder: Path) -> RankError | None:
        """The report of the rank that failed first, if any rank wrote one."""
        reports = [cls(**json.loads(path.read_text())) for path in folder.glob("error-rank-*.json")]
        return min(reports, key=lambda report: report.time, default=None)


def end_process_group() -> None:
    """Destroy the launch's process group once the job is done, as torch asks of a process before
    it exits. (Alone it did not stop the aborts at exit: :mod:`trainers.runtime.fast_exit`.)"""
    import torch.distributed

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


EXIT_CODE = 1  # of a launched process, until its job has returned (:func:`run_as_launched_process`)


def run_as_launched_process(job: Callable[[], None], error_folder: Path | None = None) -> None:
    """Run ``job`` as the body of this launched process, which then exits 0, or 1 when it raised
    (after the traceback, and this rank's :class:`RankError` in ``error_folder``), without
    interpreter teardown (:mod:`trainers.runtime.fast_exit`). The exit hooks registered before this call
    do not run: in ``tasks.launched_rank``, from its imports, multiprocessing's exit function and
    MLflow's end of a fluent run. A rank needs neither: it starts no multiprocessing children and
    no fluent run, and closes its metrics sender when training ends."""
    global EXIT_CODE
    end_at_exit_without_teardown(lambda: EXIT_CODE)
    try:
        job()
    except BaseException as error:
        if error_folder is not None:
            report = RankError(rank(), time.time(), type(error).__name__, traceback.format_exc())
            RankError.path(error_folder, report.rank).write_text(json.dumps(asdict(report)))
        raise
    end_process_group()
    EXIT_CODE = 0
