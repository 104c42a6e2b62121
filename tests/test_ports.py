"""Ports chosen before their server binds them come from below the kernel's ephemeral range, so no
outgoing connection's source port can take them meanwhile (``infra.core.ports``)."""

from __future__ import annotations

import errno
import random
import socket

import pytest

from infra.core import ports
from infra.core.ports import LOWEST, bind_error, ephemeral_range, free_port

pytestmark = pytest.mark.unit


@pytest.fixture
def linux_default_range(tmp_path):
    source = tmp_path / "ip_local_port_range"
    source.write_text("32768\t60999\n")
    return source


def listening_on(port: int) -> socket.socket:
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen()
    return server


def test_the_range_is_read_from_the_kernel_and_defaults_to_linuxs(linux_default_range, tmp_path):
    assert ephemeral_range(linux_default_range) == (32768, 60999)
    assert ephemeral_range(tmp_path / "missing") == (32768, 60999)


def test_a_port_below_the_ephemeral_range_that_a_server_can_bind(linux_default_range):
    port = free_port(source=linux_default_range)
    assert LOWEST <= port < 32768
    listening_on(port).close()


def test_a_port_something_listens_on_cannot_be_bound_until_it_closes(linux_default_range):
    server = listening_on(free_port(source=linux_default_range))
    host, port = server.getsockname()
    assert bind_error(host, port).errno == errno.EADDRINUSE
    server.close()
    assert bind_error(host, port) is None


def test_a_port_something_listens_on_is_skipped(linux_default_range, monkeypatch):
    taken = listening_on(free_port(source=linux_default_range))
    other = free_port(source=linux_default_range)
    draws = iter([taken.getsockname()[1] - LOWEST, other - LOWEST])
    monkeypatch.setattr(ports.secrets, "randbelow", lambda bound: next(draws))
    try:
        assert free_port(source=linux_default_range) == other
    finally:
        taken.close()


def test_processes_that_seeded_random_alike_do_not_draw_alike(linux_default_range):
    random.seed(0)
    first = [free_port(source=linux_default_range) for _ in range(4)]
    random.seed(0)
    second = [free_port(source=linux_default_range) for _ in range(4)]
    assert first != second


def test_with_no_room_below_the_range_the_kernel_picks(tmp_path):
    source = tmp_path / "ip_local_port_range"
    source.write_text(f"{LOWEST}\t60999\n")
    port = free_port(source=source)
    low, high = ephemeral_range()  # this machine's: where the kernel draws from
    assert low <= port <= high
