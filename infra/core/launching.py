"""Run a launcher command (``accelerate launch``) as a process group of its own, tied to this process.

Its output (stdout and stderr) is handed over line by line while it runs. The launcher starts in
a session of its own, so that a Ctrl-C or a signal to this process's group reaches this process
first, which then stops the launcher's whole group (SIGTERM, then SIGKILL after a grace period)
whenever it stops waiting for it: an exception, a cancellation (Prefect's ``TerminationSignal``),
an interrupt. Should this process die without that (SIGKILL), Linux sends the launcher SIGTERM
(``PR_SET_PDEATHSIG``, :func:`stop_with_parent`).

torch's launcher starts each rank in a session of its own and stops them itself on SIGTERM; a
rank started through it calls :func:`stop_with_parent` too, for a launcher that was SIGKILLed.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

STOP_GRACE_S = 15.0  # below the 30 s a Prefect runner waits before it SIGKILLs a cancelled flow run's process


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def stop_with_parent() -> None:
    """In a child process before it starts (``preexec_fn``), or in a process of a launch: Linux sends
    it SIGTERM when its parent dies, even by SIGKILL, so a killed run leaves nothing behind (the
    temporary Prefect server, a launch and its ranks)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass(frozen=True)
class Finished:
    returncode: int
    tail: list[str]  # the last lines of its output


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_group(process: subprocess.Popen, grace: float = STOP_GRACE_S) -> None:
    """SIGTERM to the process's group; SIGKILL to what is left of it after ``grace`` seconds."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        process.poll()  # reap the leader: a zombie still counts as a member of its group
        if not group_alive(process.pid):
            return
        time.sleep(0.1)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def run_process_group(
    command: Sequence[str],
    on_line: Callable[[str], None],
    *,
    cwd: Path | str | None = None,
    env: dict[str, str] | None = None,
    tail_lines: int = 60,
) -> Finished:
    """Run ``command`` to its end, calling ``on_line`` with each line of its output; its group is
    stopped however this returns or raises."""
    process = subprocess.Popen(
        list(command),
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        bufsize=1,
        start_new_session=True,
        preexec_fn=stop_with_parent,
    )
    tail: deque[str] = deque(maxlen=tail_lines)
    try:
        for line in process.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            on_line(line)
        process.wait()
    finally:
        stop_group(process)  # a cancelled wait, or members left behind by a launcher that exited
        process.stdout.close()
    return Finished(process.returncode, list(tail))
