"""Concurrent ``/generate`` requests to the vLLM server (one per training rank) served together:
a request that finds the engine busy waits, and the next engine call takes every request waiting
then, in one ``generate`` (:func:`trainers.generation.vllm_engine.sample_requests`), each with its own
sampling, and hands each its own completions."""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Future
from typing import Callable, Generic, TypeVar

Request = TypeVar("Request")
Result = TypeVar("Result")


@dataclasses.dataclass(eq=False)
class Pending(Generic[Request, Result]):
    request: Request
    outcome: Future[Result] = dataclasses.field(default_factory=Future)  # its result, or the call's error


class Batcher(Generic[Request, Result]):
    """Serves requests by ``run`` (requests in, one result per request out, in order), one call at a
    time under ``engine_lock``, each call taking every request then waiting. ``calls`` counts them."""

    def __init__(self, run: Callable[[list[Request]], list[Result]], engine_lock: threading.Lock):
        self.run, self.engine_lock = run, engine_lock
        self.pending: list[Pending[Request, Result]] = []
        self.queue_lock = threading.Lock()
        self.calls = 0

    def waiting(self) -> int:
        with self.queue_lock:
            return len(self.pending)

    def submit(self, request: Request) -> Result:
        mine: Pending[Request, Result] = Pending(request)
        with self.queue_lock:
            self.pending.append(mine)
        with self.engine_lock:
            with self.queue_lock:
                batch, self.pending = self.pending, []
            if batch:  # else an earlier call took this request too
                self.calls += 1
                try:
                    results = self.run([pending.request for pending in batch])
                except BaseException as error:  # every request of the call gets its error
                    for pending in batch:
                        pending.outcome.set_exception(error)
                else:
                    for pending, result in zip(batch, results, strict=True):
                        pending.outcome.set_result(result)
        return mine.outcome.result()
