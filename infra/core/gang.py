"""The machines of one multi-machine launch as a gang, through files in its launch folder, which is
on storage every machine shares (the state folder): all of them start, or none does; when one
fails, every other stops.

Each machine's part of a launch (machine 0's train, reference or evaluation task; on every other
machine ``python -m tasks.machine``) joins before it starts its ranks: it writes
``machine-<M>.alive`` and refreshes it while it runs. Then it waits until every machine has
joined, up to ``compute.join_timeout``; a machine that has not joined by then is named in the
error of every machine that waits, and no rank starts anywhere. While the ranks run, each machine
watches the others: a rank's error report (``error-rank-<R>.json``, ``trainers.runtime.launched_process``), a
machine that ended its part with a failure (``machine-<M>.failed``) or one whose heartbeat
stopped (its process was killed) stops the local ranks.

A heartbeat is judged by this machine's clock only (how long since its file last changed, as
seen here), so clocks that disagree between machines do not matter.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from trainers.runtime.launched_process import RankError

HEARTBEAT_S = 2.0  # how often a machine refreshes its file
POLL_S = 0.5
# After this machine's ranks failed: how long another machine may neither beat nor report its own
# stop before it counts as gone (its part killed, its host lost). Three heartbeats.
GONE_WINDOW_S = 3 * HEARTBEAT_S


class GangError(RuntimeError):
    """The gang did not start (a machine did not join) or stopped (another machine failed)."""


@dataclass
class Gang:
    """Machine ``machine``'s view of the gang of ``machines`` machines launching from ``folder``."""

    folder: Path
    machines: int
    machine: int
    join_timeout: float
    stale_after: float = 30.0  # seconds without a heartbeat after which a joined machine counts as gone
    _beaten: float = 0.0
    _seen: dict[int, tuple[float, float]] = field(default_factory=dict)  # machine -> (mtime, when seen here)

    def alive_file(self, machine: int) -> Path:
        return self.folder / f"machine-{machine}.alive"

    def failed_file(self, machine: int) -> Path:
        return self.folder / f"machine-{machine}.failed"

    def others(self) -> list[int]:
        return [m for m in range(self.machines) if m != self.machine]

    def beat(self) -> None:
        """Join, or tell the others this machine's part still runs (at most every HEARTBEAT_S)."""
        now = time.monotonic()
        if now - self._beaten >= HEARTBEAT_S:
            record = {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}
            try:
                self.alive_file(self.machine).write_text(json.dumps(record))
            except FileNotFoundError:
                pass  # machine 0 removed the launch folder: the launch is over
            self._beaten = now

    def hosts(self) -> list[str]:
        """The host each machine's part ran on, in machine order ("?" for one that never joined)."""
        found = []
        for machine in range(self.machines):
            try:
                found.append(json.loads(self.alive_file(machine).read_text())["host"])
            except (OSError, ValueError, KeyError):
                found.append("?")
        return found

    def joined(self, machine: int) -> bool:
        return self.alive_file(machine).exists()

    def missing(self) -> list[int]:
        return [m for m in self.others() if not self.joined(m)]

    def wait_for_all(self, lost: Callable[[], str | None] = lambda: None) -> None:
        """Join and wait until every machine has joined; :class:`GangError` naming the machines
        that did not within ``join_timeout`` seconds, the reason another one gave up, or why
        ``lost`` says one never will (its part ended where it was placed)."""
        deadline = time.monotonic() + self.join_timeout
        while True:
            self.beat()
            reason = self.failure() or lost()
            if reason is not None:
                raise GangError(reason)
            missing = self.missing()
            if not missing:
                return
            if time.monotonic() >= deadline:
                names = ", ".join(str(m) for m in missing)
                word = "machine" if len(missing) == 1 else "machines"
                raise GangError(f"{word} {names} did not join within {self.join_timeout:g} s (compute.join_timeout)")
            time.sleep(POLL_S)

    def failure(self) -> str | None:
        """Why the local ranks must stop, if they must: another machine failed, a rank of any
        machine reported an error, or a joined machine's heartbeat stopped."""
        for machine in self.others():
            failed = self.failed_file(machine)
            if failed.exists():
                return f"machine {machine} failed: {failed.read_text().strip()}"
        first = RankError.first(self.folder)
        if first is not None:
            return f"rank {first.rank} failed ({first.error})"
        now = time.monotonic()
        for machine in self.others():
            mtime = self.heartbeat_time(machine)
            if mtime is None:
                continue
            last_mtime, seen = self._seen.get(machine, (None, now))
            if mtime != last_mtime:
                self._seen[machine] = (mtime, now)
            elif now - seen > self.stale_after:
                return f"machine {machine} stopped answering (no heartbeat for {self.stale_after:g} s)"
        return None

    def heartbeat_time(self, machine: int) -> float | None:
        try:
            return self.alive_file(machine).stat().st_mtime
        except FileNotFoundError:
            return None

    def gone_silent(self, window: float = GONE_WINDOW_S) -> list[int]:
        """The other machines that, watched for up to ``window`` seconds, neither beat nor reported a
        failure. Asked once this machine's ranks failed: a machine still there stops its own ranks
        and says so (``machine-<M>.failed``); one whose part was killed says nothing, and its
        loss is what the local ranks' connection errors mean."""
        pending = {machine: self.heartbeat_time(machine) for machine in self.others()}
        deadline = time.monotonic() + window
        while pending and time.monotonic() < deadline:
            time.sleep(POLL_S)
            for machine, seen in list(pending.items()):
                if self.failed_file(machine).exists() or self.heartbeat_time(machine) != seen:
                    del pending[machine]
        return sorted(pending)

    def watch(self) -> str | None:
        """While the ranks run (``run_process_group``'s ``watch``): beat, and why to stop, if any."""
        self.beat()
        return self.failure()

    def fail(self, reason: str) -> None:
        """Tell the other machines this machine's part failed (they stop theirs)."""
        try:
            self.failed_file(self.machine).write_text(reason.splitlines()[0] if reason else "failed")
        except FileNotFoundError:
            pass  # the launch folder is gone: nobody is left to tell
