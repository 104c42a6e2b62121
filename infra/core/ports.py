"""Ports chosen before the process that listens on them binds them: a temporary Prefect server, a
test's servers, the rendezvous of launched ranks.

``bind(("127.0.0.1", 0))`` answers with a port from the kernel's ephemeral range, the range the
kernel also draws every outgoing connection's source port from: between the probe and the
server's own bind, any client on the machine can take it (a test suite's Dask client once
connected to another process's listener there and waited 180 s for an answer). A port below that
range is never handed out by the kernel: only another explicit bind can take it.
"""

from __future__ import annotations

import secrets
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 20000  # above the registered services people run on a workstation (PostgreSQL, MLflow, Prefect, ...)
ATTEMPTS = 64


def ephemeral_range(source: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default where the file cannot be read)."""
    try:
        low, high = source.read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def bind_error(host: str, port: int) -> OSError | None:
    """Why ``port`` of ``host`` cannot be bound now (another process listens there), or None. Bound
    as servers bind: a connection lingering in TIME_WAIT there is no conflict."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            return error
    return None


def free_port(host: str = "127.0.0.1", source: Path = EPHEMERAL_RANGE_FILE) -> int:
    """A port of ``host`` nothing listens on now, below the ephemeral range when there is room
    (drawn from the OS's randomness, not ``random``'s: processes that seeded ``random`` alike must
    not draw alike), else one the kernel picks."""
    low, _ = ephemeral_range(source)
    for _ in range(ATTEMPTS if low > LOWEST else 0):
        port = LOWEST + secrets.randbelow(low - LOWEST)
        if bind_error(host, port) is None:
            return port
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]
