"""Which process runs a run, recorded so that a later process can tell whether it is still alive.

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
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


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
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()  # the command name may hold spaces and parentheses


def boot_id() -> str:
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return "unknown"


def process_record(pid: int | None = None) -> ProcessRecord:
    """The record of process ``pid`` (default: this process)."""
    pid = pid or os.getpid()
    fields = stat_fields(pid)
    if fields is None:
        raise ProcessLookupError(f"no process {pid}")
    return ProcessRecord(host=socket.gethostname(), pid=pid, start_ticks=int(fields[19]), boot_id=boot_id())


def is_this_host(record: ProcessRecord) -> bool:
    return record.host == socket.gethostname()


def is_alive(record: ProcessRecord) -> bool:
    """True while the recorded process runs: same boot, the pid exists, is no zombie and started at
    the recorded tick (else the pid was reused). Only meaningful for a record of this host."""
    if record.boot_id != boot_id():
        return False
    fields = stat_fields(record.pid)
    return fields is not None and fields[0] != "Z" and int(fields[19]) == record.start_ticks
