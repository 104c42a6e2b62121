"""The gang of a multi-machine launch (``infra.core.gang``): joining, the join timeout, and what
stops a machine's ranks, on files in a folder (the shared launch folder) and this machine's clock;
and when a Dask worker's part of a launch can be a task run of the flow run (``tasks.placement``)."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from infra.core.gang import Gang, GangError
from tasks.placement import reaches_api

pytestmark = pytest.mark.unit


def test_every_machine_joins_then_the_wait_ends_and_the_hosts_are_known(tmp_path):
    zero, one = (Gang(tmp_path, 2, machine, join_timeout=5) for machine in (0, 1))
    one.beat()
    zero.wait_for_all()
    assert zero.missing() == [] and zero.hosts() == [socket.gethostname()] * 2
    assert json.loads(zero.alive_file(1).read_text())["host"] == socket.gethostname()
    assert zero.failure() is None


def test_a_machine_that_does_not_join_is_named_when_the_join_timeout_ends(tmp_path):
    three = Gang(tmp_path, 3, 0, join_timeout=0.4)
    Gang(tmp_path, 3, 2, join_timeout=0.4).beat()
    started = time.monotonic()
    with pytest.raises(GangError, match=r"^machine 1 did not join within 0.4 s \(compute.join_timeout\)$"):
        three.wait_for_all()
    assert 0.4 <= time.monotonic() - started < 5
    assert three.hosts() == [socket.gethostname(), "?", socket.gethostname()]


def test_a_failed_machine_a_rank_error_or_a_stopped_heartbeat_stops_the_others(tmp_path):
    zero, one = Gang(tmp_path, 2, 0, join_timeout=5, stale_after=0.4), Gang(tmp_path, 2, 1, join_timeout=5)
    one.beat()
    assert zero.watch() is None
    time.sleep(0.6)  # machine 1's file unchanged for longer than stale_after, as seen here
    assert zero.watch() == "machine 1 stopped answering (no heartbeat for 0.4 s)"
    one.fail("its launch exited with code 1\nand more lines")
    assert zero.failure() == "machine 1 failed: its launch exited with code 1"
    (tmp_path / "machine-1.failed").unlink()
    error = {"rank": 1, "time": time.time(), "error": "ConnectionError", "traceback": "..."}
    (tmp_path / "error-rank-1.json").write_text(json.dumps(error))
    assert zero.failure() == "rank 1 failed (ConnectionError)"


def test_a_machine_outliving_the_launch_folder_neither_beats_nor_fails_into_it(tmp_path):
    gone = Gang(tmp_path / "removed", 2, 1, join_timeout=5)
    gone.beat()
    gone.fail("stopped")
    assert not (tmp_path / "removed").exists()


def test_after_a_local_failure_a_machine_that_neither_beats_nor_reports_its_stop_counts_as_gone(tmp_path):
    zero = Gang(tmp_path, 3, 0, join_timeout=5)
    for machine in (1, 2):
        Gang(tmp_path, 3, machine, join_timeout=5).beat()
    started = time.monotonic()
    assert zero.gone_silent(window=0.3) == [1, 2]  # both silent for the whole window
    assert 0.3 <= time.monotonic() - started < 2
    Gang(tmp_path, 3, 2, join_timeout=5).fail("stopped: machine 0 failed")  # there: it stopped its ranks, said so
    assert zero.gone_silent(window=0.3) == [1]
    (tmp_path / "machine-2.failed").unlink()
    beat = threading.Timer(0.2, Gang(tmp_path, 3, 2, join_timeout=5).beat)  # machine 2 beats within the window
    beat.start()
    assert zero.gone_silent(window=0.8) == [1]
    beat.join()


def test_a_machines_part_is_a_task_run_only_where_its_worker_reaches_the_prefect_api():
    server, temporary = "http://10.0.0.1:4200/api", "http://127.0.0.1:4321/api"
    assert reaches_api(server, ["tcp://10.0.0.2:39000"]) is True
    assert reaches_api(server, []) is True  # a worker that joins later reaches it too
    assert reaches_api(temporary, ["tcp://127.0.0.1:39000"]) is True  # a worker on this host
    assert reaches_api(temporary, ["tcp://10.0.0.2:39000"]) is False  # machine 1 cannot reach 127.0.0.1
    assert reaches_api(temporary, ["tcp://127.0.0.1:39000", "tcp://10.0.0.2:39000"]) is False
    assert reaches_api(temporary, []) is False  # no worker offers the machine yet
    assert reaches_api(None, ["tcp://127.0.0.1:39000"]) is False
