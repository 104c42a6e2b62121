"""Process groups started in a session of their own (:class:`ProcessGroup`): a launcher command
(``accelerate launch``, :func:`run_process_group`), the servers of ``alignflow servers``, the
temporary Prefect server and ``alignflow worker``'s worker.

A launch is tied to this process. Its output (stdout and stderr) is handed over line by line
while it runs. The launcher starts in a session of its own, so that a Ctrl-C or a signal to this
process's group reaches this process first, which then stops the launcher's whole group (SIGTERM,
then SIGKILL after a grace period) whenever it stops waiting for it: an exception, a cancellation
(Prefect's ``TerminationSignal``), an interrupt. Should this process die without that (SIGKILL),
Linux sends the launcher SIGTERM (``PR_SET_PDEATHSIG``, :func:`stop_with_parent`).

torch's launcher starts each rank in a session of its own and stops them itself on SIGTERM; a
rank started through it calls :func:`stop_with_parent` too, for a launcher that was SIGKILLed.
"""

from __future__ import annotations

import contextvars
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable, Sequence, Union

from infra.core.processes import group_members

STOP_GRACE_S = 15.0  # below the 30 s a Prefect runner waits before it SIGKILLs a cancelled flow run's process


PR_SET_PDEATHSIG = 1  # linux/prctl.h
POLL_S = 0.05
WATCH_S = 0.5  # between a launch's watch calls (run_process_group)
Stream = Union[int, IO, None]  # what subprocess.Popen takes for stdin, stdout, stderr


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
    stopped_because: str | None = None  # why the watch stopped it (``run_process_group``)


@dataclass(frozen=True)
class ProcessGroup:
    """A process group; its id is its leader's pid. Either started here (:meth:`start`: ``process``
    is the leader, which this process reaps) or known by its id only (a pid file's)."""

    pgid: int
    process: subprocess.Popen | None = None

    @classmethod
    def start(
        cls,
        command: Sequence[str],
        *,
        cwd: Path | str | None = None,
        env: dict[str, str] | None = None,
        stdin: Stream = subprocess.DEVNULL,
        stdout: Stream = None,
        stderr: Stream = None,
        text: bool = False,
        tied_to_parent: bool = True,
    ) -> ProcessGroup:
        """Start ``command`` as the leader of a new session (so of a new process group). ``text``: its
        pipes carry lines of text (undecodable bytes replaced). ``tied_to_parent``: it gets SIGTERM when
        this process dies (:func:`stop_with_parent`); False for a server meant to outlive its starter."""
        process = subprocess.Popen(
            list(command),
            cwd=cwd,
            env=env,
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
            preexec_fn=stop_with_parent if tied_to_parent else None,
            text=text,
            errors="replace" if text else None,
            bufsize=1 if text else -1,  # text: line-buffered; else Popen's default
        )
        return cls(process.pid, process)

    @property
    def leader(self) -> subprocess.Popen:
        """The leader process, of a group started here (:meth:`start`)."""
        if self.process is None:
            raise ValueError(f"process group {self.pgid} was not started by this process")
        return self.process

    def output(self) -> IO[str]:
        """The leader's output, of a group started here with ``stdout=subprocess.PIPE`` and ``text``."""
        if self.leader.stdout is None:
            raise ValueError(f"process group {self.pgid}: its output is not piped to this process")
        return self.leader.stdout

    def poll(self) -> int | None:
        """The leader's exit status once it has exited (reaping it), else None; None for a group not started here."""
        return self.process.poll() if self.process is not None else None

    def alive(self) -> bool:
        """True while a live process is left in the group. A zombie still counts as a member of its group
        (a signal to the group reaches it) until its parent reaps it: the leader, if it is ours, is reaped
        first, and zombies left (whose parents are outside the group) count as gone."""
        self.poll()
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # another user's group: it has members
        members = group_members(self.pgid)
        return True if members is None else bool(members)  # None: no /proc; killpg found members

    def signal(self, signum: int) -> bool:
        """Send ``signum`` to every member; False when the group is gone."""
        try:
            os.killpg(self.pgid, signum)
        except ProcessLookupError:
            return False
        return True

    def wait_gone(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until no live member is left; True if none is."""
        deadline = time.monotonic() + timeout
        while self.alive():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.pause(min(POLL_S, left))
        return True

    def pause(self, seconds: float) -> None:
        """Sleep ``seconds``, or less when the leader (ours, still running) exits meanwhile."""
        if self.process is not None and self.process.returncode is None:
            try:
                self.process.wait(timeout=seconds)
            except subprocess.TimeoutExpired:
                pass
        else:
            time.sleep(seconds)

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """SIGTERM to the group; SIGKILL to what is left of it after ``grace`` seconds; then wait, up to
        ``grace`` seconds again, until no member is left (the leader, if ours, reaped)."""
        if self.signal(signal.SIGTERM) and not self.wait_gone(grace):
            self.signal(signal.SIGKILL)
            self.wait_gone(grace)
        self.end_leader(grace)

    def end_leader(self, grace: float) -> None:
        """Reap our leader, SIGKILLed if it still runs after ``grace`` seconds: one that left the group
        (or was not counted in it) must not outlive a stop."""
        if self.process is None:
            return
        try:
            self.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def group_alive(pgid: int) -> bool:
    """:meth:`ProcessGroup.alive` of the group ``pgid``."""
    return ProcessGroup(pgid).alive()


def stop_group(process: subprocess.Popen, grace: float = STOP_GRACE_S) -> None:
    """:meth:`ProcessGroup.stop` of the group that ``process`` (started in a session of its own) leads."""
    ProcessGroup(process.pid, process).stop(grace)


def read_lines(stream: IO[str], on_line: Callable[[str], None], tail: deque[str]) -> None:
    """Hand each line of ``stream`` but the blank ones to ``on_line``, keeping the last ones in ``tail``."""
    for line in stream:
        line = line.rstrip("\n")
        if not line.strip():  # a progress bar's carriage returns read as lines too (universal newlines)
            continue
        tail.append(line)
        on_line(line)


def output_reader(stream: IO[str], on_line: Callable[[str], None], tail: deque[str], name: str) -> threading.Thread:
    """:func:`read_lines` in a daemon thread, started, in this thread's context: what ``on_line`` logs
    to (a Prefect task run's logger) is the caller's."""
    reader = threading.Thread(
        target=contextvars.copy_context().run, args=(read_lines, stream, on_line, tail), name=name, daemon=True
    )
    reader.start()
    return reader


def run_process_group(
    command: Sequence[str],
    on_line: Callable[[str], None],
    *,
    cwd: Path | str | None = None,
    env: dict[str, str] | None = None,
    tail_lines: int = 60,
    watch: Callable[[], str | None] | None = None,
) -> Finished:
    """Run ``command`` to its end, calling ``on_line`` with each line of its output; its group is
    stopped however this returns or raises. ``watch`` is asked every ``WATCH_S`` seconds while it
    runs: a reason it returns stops the group, and is the result's ``stopped_because``."""
    group = ProcessGroup.start(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    process, output = group.leader, group.output()
    tail: deque[str] = deque(maxlen=tail_lines)
    reason = None
    try:
        if watch is None:
            read_lines(output, on_line, tail)
        else:
            reader = output_reader(output, on_line, tail, "launch-output")
            while reader.is_alive() and reason is None:
                reader.join(WATCH_S)
                reason = watch() if reader.is_alive() else None
            if reason is not None:
                group.stop()
            reader.join()
        process.wait()
    finally:
        group.stop()  # a cancelled wait, or members left behind by a launcher that exited
        output.close()
    return Finished(process.returncode, list(tail), reason)
