"""One machine's part of a launched job (:data:`infra.core.stage_io.LaunchSpec`): join the other
machines (:mod:`infra.core.gang`), run ``accelerate launch`` of :mod:`tasks.launched_rank` over its
processes, and turn a failed launch into the error of the rank that failed first.

Machine 0's part runs in the pipeline's task (:mod:`tasks.launch`); another machine's part is
``python -m tasks.machine SPEC --machine-rank M``, where a worker or a person starts it. Like a
rank, it imports no Prefect (nor MLflow): it joins as soon as its interpreter is up.
"""

from __future__ import annotations

import argparse
import functools
import os
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Callable, Mapping

from infra.core.config import launcher_temp_folder
from infra.core.gang import Gang, GangError
from infra.core.launching import Finished, run_process_group
from infra.core.settings import get_settings
from infra.core.stage_io import LAUNCHED_AT, LaunchSpec, read_spec
from trainers.runtime.launched_process import RankError

PROJECT_ROOT = Path(__file__).resolve().parents[1]
RANK_MODULE = "tasks.launched_rank"  # run as `-m` in every process
TRACEBACK_LINES = 25  # of the failed rank's traceback, in the task's error


class LaunchFailed(RuntimeError):
    """A launched job failed: the message holds the failed rank's traceback."""


def failure(
    name: str,
    finished: Finished,
    launch_dir: Path,
    gang: Gang | None,
    repeating: Mapping[str, type[Exception]],
) -> Exception:
    """The task's error for a launch that exited with ``finished.returncode``: the traceback of the
    rank that failed first, on any machine (else why the launch was stopped, or its last output
    lines); a rank's error named in ``repeating`` as that type. With several machines (this one's
    view of their ``gang``), a rank's error that follows another machine's loss names that machine
    first: a rank sees only a closed connection."""
    first = RankError.first(launch_dir)
    if first is not None:
        lines = first.traceback.rstrip().splitlines()[-TRACEBACK_LINES:]
        message = f"rank {first.rank} failed ({first.error}):\n" + "\n".join(lines)
        gone = gang.gone_silent() if gang is not None else []
        if gone:
            machines = ", ".join(str(machine) for machine in gone)
            word = "machine" if len(gone) == 1 else "machines"
            lost = f"{word} {machines} stopped answering and reported no failure (killed, or its host lost); then "
            return LaunchFailed(f"{name}: {lost}{message}")
        return repeating.get(first.error, LaunchFailed)(f"{name}: {message}")
    if finished.stopped_because is not None:
        return LaunchFailed(f"{name}: stopped: {finished.stopped_because}")
    detail = "no rank reported an error; the launch's last output:\n" + "\n".join(finished.tail[-TRACEBACK_LINES:])
    return LaunchFailed(f"{name}: the launch exited with code {finished.returncode}; {detail}")


def checkout_command(argv: list[str]) -> str:
    """``argv`` as another machine runs it: from the same checkout, with the shared state folder."""
    home = f"ALIGNFLOW_HOME={shlex.quote(str(get_settings().root))}"
    return f"cd {shlex.quote(str(PROJECT_ROOT))} && {home} {shlex.join(argv)}"


def machine_command(spec: LaunchSpec, machine: int) -> str:
    """What machine ``machine`` runs for its part of ``spec``'s launch, from the same checkout."""
    return checkout_command(machine_runner(spec.spec_file, machine))


def machine_runner(spec_file: Path, machine: int) -> list[str]:
    """The command of machine ``machine``'s part of the launch whose spec is ``spec_file`` (:func:`main`)."""
    return [sys.executable, "-m", __name__, str(spec_file), "--machine-rank", str(machine)]


def gang_of(spec: LaunchSpec, machine: int) -> Gang:
    """Machine ``machine``'s view of the gang of ``spec``'s launch."""
    compute = spec.compute
    return Gang(spec.launch_dir, compute.num_machines, machine, compute.join_timeout)


def ended_because(finished: Finished | None) -> str:
    if finished is None:
        return "its part was stopped before its launch ended (cancelled, interrupted or timed out)"
    return finished.stopped_because or f"its launch exited with code {finished.returncode}"


def run_machine(
    spec: LaunchSpec,
    machine: int,
    name: str,
    log: Callable[[str], None],
    lost: Callable[[], str | None] = lambda: None,
) -> Finished:
    """Machine ``machine``'s part of ``spec``'s launch: with several machines, join the others (a
    :class:`LaunchFailed` naming those that do not join in time, or the part ``lost`` reports ended
    where it was placed) and stop when one of them fails; then ``accelerate launch`` of this
    machine's ranks, each output line to ``log``."""
    compute = spec.compute.model_copy(update={"machine_rank": machine})
    gang = None
    if compute.num_machines > 1:
        gang = gang_of(spec, machine)
        log(f"{name}: machine {machine} joined; waiting up to {compute.join_timeout} s for the others")
    finished, reason = None, None
    temporary = spec.launch_dir / f"tmp-{machine}"  # the launcher's temp folder (removed below)
    try:
        if gang is not None:
            try:
                gang.wait_for_all(lost)
            except GangError as error:
                reason = str(error)
                raise LaunchFailed(f"{name}: {error}") from None
        command = compute.launch_command(spec.spec_file, RANK_MODULE)
        log(f"{name} on {compute.num_processes} processes: {shlex.join(command)}")
        # each line as it is printed, and no progress bars (transformers' "Loading weights"): every
        # frame of one would be a line of the task's logs
        env = os.environ | {
            "PYTHONUNBUFFERED": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            **launcher_temp_folder(temporary),
            LAUNCHED_AT: str(time.time()),
        }
        finished = run_process_group(command, log, cwd=PROJECT_ROOT, env=env, watch=gang.watch if gang else None)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
        if gang is not None and (finished is None or finished.returncode != 0):
            gang.fail(reason or ended_because(finished))  # the other machines stop theirs
    return finished


def run_part(
    spec: LaunchSpec, machine: int, name: str, log: Callable[[str], None], repeating: Mapping[str, type[Exception]]
) -> Finished:
    """Machine ``machine``'s part (not machine 0's) where it was started, by a placement or by hand:
    :func:`run_machine`, and a launch that exits non-zero raised as its :func:`failure`."""
    finished = run_machine(spec, machine, name, log)
    if finished.returncode != 0:
        raise failure(name, finished, spec.launch_dir, gang_of(spec, machine), repeating)
    return finished


def main(argv: list[str] | None = None) -> None:
    """``python -m tasks.machine SPEC --machine-rank M``: machine M's part of a multi-machine launch
    (what machine 0's task logs as :func:`machine_command`)."""
    parser = argparse.ArgumentParser(prog="python -m tasks.machine", description=main.__doc__)
    parser.add_argument("spec", type=Path, help="the launch's spec.json, on the shared state folder")
    parser.add_argument("--machine-rank", type=int, required=True)
    args = parser.parse_args(argv)
    spec = read_spec(args.spec)
    if not 0 < args.machine_rank < spec.compute.num_machines:
        raise SystemExit(f"--machine-rank must be 1..{spec.compute.num_machines - 1} (machine 0 runs the task)")
    try:  # only the error's text is printed: no error type is kept
        run_part(spec, args.machine_rank, f"machine {args.machine_rank}", functools.partial(print, flush=True), {})
    except LaunchFailed as error:
        raise SystemExit(str(error)) from None


if __name__ == "__main__":
    main()
