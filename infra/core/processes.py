"""What Linux's ``/proc`` tells of processes (the one place that reads it), and which process runs a
run, recorded so that a later process can tell whether it is still alive.

A record is the host name, the pid, the process's start time (field 22 of ``/proc/<pid>/stat``:
clock ticks after boot) and the boot id. A pid is reused after its process exits; the start time
and the boot id tell the reuse from the original. Only records of this host can be checked.
"""

from __future__ import annotations

import os
import socket
from dataclasses import asdict, dataclass
from pathlib import Path

TAG_PREFIX = "alignflow.process."
PROC = Path("/proc")
BOOT_ID = PROC / "sys/kernel/random/boot_id"
LISTEN = "0A"  # TCP_LISTEN, the state column ("st") of /proc/net/tcp


@dataclass(frozen=True)
class ProcessRecord:
    host: str
    pid: int
    start_ticks: int
    boot_id: str

    def tags(self) -> dict[str, str]:
        """``alignflow.process.<field>: value`` (MLflow tags, Prefect labels)."""
        return {TAG_PREFIX + name: str(value) for name, value in asdict(self).items()}

    @classmethod
    def from_tags(cls, tags: dict) -> ProcessRecord | None:
        """The record in ``tags`` (see :meth:`tags`); None when they hold none (or a damaged one)."""
        try:
            return cls(
                host=tags[TAG_PREFIX + "host"],
                pid=int(tags[TAG_PREFIX + "pid"]),
                start_ticks=int(tags[TAG_PREFIX + "start_ticks"]),
                boot_id=tags[TAG_PREFIX + "boot_id"],
            )
        except (KeyError, ValueError, TypeError):
            return None

    def __str__(self) -> str:
        return f"pid {self.pid} on {self.host} (started at tick {self.start_ticks})"


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (field 3 first); None if there is no such process."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()  # the command name may hold spaces and parentheses


@dataclass(frozen=True)
class ProcStat:
    """The fields of ``/proc/<pid>/stat`` that alignflow reads."""

    pid: int
    state: str  # field 3: R, S, D, … Z for a zombie (exited, not yet reaped by its parent)
    ppid: int  # field 4
    pgid: int  # field 5
    start_ticks: int  # field 22: clock ticks after boot
    cpu_ticks: int  # fields 14 and 15: user and system CPU time, in clock ticks

    @property
    def zombie(self) -> bool:
        return self.state == "Z"


def proc_stat(pid: int) -> ProcStat | None:
    """Process ``pid``'s :class:`ProcStat`; None if there is no such process."""
    fields = stat_fields(pid)
    if fields is None:
        return None
    return ProcStat(pid, fields[0], int(fields[1]), int(fields[2]), int(fields[19]), int(fields[11]) + int(fields[12]))


def all_pids() -> list[int] | None:
    """Every process's pid; None where there is no ``/proc`` (not Linux)."""
    try:
        return [int(entry.name) for entry in PROC.iterdir() if entry.name.isdigit()]
    except OSError:
        return None


def group_members(pgid: int) -> list[ProcStat] | None:
    """The live processes of process group ``pgid``: zombies excluded; None where there is no ``/proc``."""
    pids = all_pids()
    if pids is None:
        return None
    stats = (proc_stat(pid) for pid in pids)
    return [stat for stat in stats if stat is not None and stat.pgid == pgid and not stat.zombie]


def pid_alive(pid: int) -> bool:
    """True for a live process (another user's too); a zombie counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = proc_stat(pid)
    return stat is None or not stat.zombie  # None: no /proc to tell a zombie by


def command_line(pid: int) -> list[bytes] | None:
    """The arguments of process ``pid``; None if it is gone or not readable."""
    try:
        return (PROC / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return None


def environment(pid: int) -> set[bytes] | None:
    """The ``NAME=value`` entries of process ``pid``'s environment; None if it is gone or another user's."""
    try:
        return set((PROC / str(pid) / "environ").read_bytes().split(b"\0"))
    except OSError:
        return None


def listening_pids(port: int) -> set[int] | None:
    """Processes with a TCP socket listening on ``port``; None when that cannot be told."""
    inodes = set()
    for table in ("net/tcp", "net/tcp6"):
        try:
            lines = (PROC / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    pids = set()
    for pid in all_pids() or []:
        try:
            fds = list((PROC / str(pid) / "fd").iterdir())
            if any(os.readlink(fd) in inodes for fd in fds):
                pids.add(pid)
        except OSError:
            continue
    return pids


def boot_id() -> str:
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return "unknown"


def process_record(pid: int | None = None) -> ProcessRecord:
    """The record of process ``pid`` (default: this process)."""
    pid = pid or os.getpid()
    stat = proc_stat(pid)
    if stat is None:
        raise ProcessLookupError(f"no process {pid}")
    return ProcessRecord(host=socket.gethostname(), pid=pid, start_ticks=stat.start_ticks, boot_id=boot_id())


def is_this_host(record: ProcessRecord) -> bool:
    return record.host == socket.gethostname()


def is_alive(record: ProcessRecord) -> bool:
    """True while the recorded process runs: same boot, the pid exists, is no zombie and started at
    the recorded tick (else the pid was reused). Only meaningful for a record of this host."""
    if record.boot_id != boot_id():
        return False
    stat = proc_stat(record.pid)
    return stat is not None and not stat.zombie and stat.start_ticks == record.start_ticks
