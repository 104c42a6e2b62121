"""The vLLM server's batcher of concurrent requests (:mod:`trainers.generation.batcher`)."""

from __future__ import annotations

import threading
import time

import pytest

from trainers.generation.batcher import Batcher

pytestmark = pytest.mark.unit


def test_requests_waiting_for_a_busy_engine_are_served_by_one_call_each_with_its_own_results():
    calls: list[list[int]] = []

    def run(requests: list[int]) -> list[int]:
        calls.append(list(requests))
        return [10 * request for request in requests]

    engine_lock = threading.Lock()
    batcher: Batcher[int, int] = Batcher(run, engine_lock)
    results: dict[int, int] = {}
    with engine_lock:
        threads = [threading.Thread(target=lambda r=r: results.update({r: batcher.submit(r)})) for r in (1, 2, 3)]
        for thread in threads:
            thread.start()
        while batcher.waiting() < 3:
            time.sleep(0.001)
    for thread in threads:
        thread.join()
    assert results == {1: 10, 2: 20, 3: 30} and batcher.calls == 1 and sorted(calls[0]) == [1, 2, 3]
    assert batcher.submit(4) == 40 and batcher.calls == 2 and calls[1] == [4]


def test_an_engine_error_reaches_every_request_of_its_call():
    def run(requests: list[int]) -> list[int]:
        raise RuntimeError("no model loaded: POST /load first")

    batcher: Batcher[int, int] = Batcher(run, threading.Lock())
    with pytest.raises(RuntimeError, match="^no model loaded: POST /load first$"):
        batcher.submit(1)
