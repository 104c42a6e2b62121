"""Metrics of one MLflow run delivered by a background thread, so that an MLflow outage does not
stall training.

:meth:`MetricSender.submit` appends to a buffer and returns at once. The sender thread posts the
buffer in batches, each request without MLflow's own retries and with a short timeout. A failure
that may pass (no answer, a timeout, HTTP 429 or 5xx) is retried after a bounded backoff, so the
buffer drains once the server answers again; an answer that rejects the batch is final.
:meth:`MetricSender.close` waits, bounded, for the buffer to drain and raises
:class:`MetricsNotDelivered` naming what is left: a run whose metrics are missing is not a success.

Retrying a batch is harmless: its metrics keep the timestamps they were submitted with, and MLflow
stores a repeated (key, step, timestamp, value) once.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from itertools import islice
from typing import Callable

from mlflow import MlflowClient
from mlflow.entities import Metric
from mlflow.exceptions import MlflowException

from infra.core.mlflow_compat import LOG_BATCH_ENDPOINT, rest_poster
from infra.core.settings import redact_url

logger = logging.getLogger("alignflow.metrics")

MAX_BATCH = 1000  # MLflow's limit of metrics per log_batch request
REQUEST_TIMEOUT_S = 10.0
MAX_BACKOFF_S = 10.0
TRANSIENT_STATUS = {429, 500, 502, 503, 504}
# Errors of a store that may pass (e.g. a SQLite store locked by another writer): retried.
TRANSIENT_CODES = {"TEMPORARILY_UNAVAILABLE", "INTERNAL_ERROR", "REQUEST_LIMIT_EXCEEDED", "DEADLINE_EXCEEDED"}


class MetricsRejected(Exception):
    """MLflow answered and refused the batch (e.g. the run was deleted): retrying cannot help."""


class MetricsNotDelivered(RuntimeError):
    """Metrics were still undelivered (or were rejected) when the sender closed."""


def backoff_seconds(failures: int, base: float = 0.5, cap: float = MAX_BACKOFF_S) -> float:
    """Wait after ``failures`` failed attempts in a row: ``min(cap, base · 2^(failures − 1))``,
    i.e. 0.5, 1, 2, 4, … seconds, never more than ``cap``."""
    return min(cap, base * 2 ** max(failures - 1, 0))


Send = Callable[[str, list[Metric]], None]


def rest_sender(tracking_uri: str, timeout: float = REQUEST_TIMEOUT_S) -> Send:
    """Post to a tracking server's REST API once per call (no urllib3 retries, ``timeout`` seconds)."""
    post = rest_poster(tracking_uri, timeout)

    def send(run_id: str, metrics: list[Metric]) -> None:
        items = [{"key": m.key, "value": m.value, "timestamp": m.timestamp, "step": m.step} for m in metrics]
        body = {"run_id": run_id, "metrics": items}
        # raises MlflowException when the server does not answer: retried
        response = post(LOG_BATCH_ENDPOINT, body)
        if response.status_code in TRANSIENT_STATUS:
            raise MlflowException(f"{tracking_uri} answered HTTP {response.status_code}")
        if response.status_code != 200:
            raise MetricsRejected(f"{tracking_uri} rejected the metrics: HTTP {response.status_code} {response.text}")

    return send


def store_sender(tracking_uri: str) -> Send:
    """Write to a store the client opens itself (SQLite, a database URL)."""
    client = MlflowClient(tracking_uri)

    def send(run_id: str, metrics: list[Metric]) -> None:
        try:
            client.log_batch(run_id, metrics=metrics)
        except MlflowException as error:
            if error.error_code not in TRANSIENT_CODES:
                raise MetricsRejected(f"{tracking_uri} rejected the metrics: {error}") from error
            raise

    return send


SENDERS: dict[str, Callable[[str], Send]] = {"http": rest_sender, "https": rest_sender}


def sender_for(tracking_uri: str) -> Send:
    return SENDERS.get(tracking_uri.split("://", 1)[0], store_sender)(tracking_uri)


def steps_of(metrics: list[Metric]) -> str:
    steps = sorted({m.step for m in metrics})
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}–{steps[-1]}"


class MetricSender:
    """One run's metric buffer and the thread that delivers it (see the module docstring)."""

    def __init__(self, run_id: str, send: Send, max_backoff: float = MAX_BACKOFF_S, where: str = "MLflow"):
        self.run_id, self.send, self.max_backoff, self.where = run_id, send, max_backoff, where
        self.buffer: deque[Metric] = deque()
        self.rejected: list[Metric] = []
        self.failures = 0
        self.last_error: Exception | None = None
        self.closing = self.abandoned = self.hurry = False
        self.changed = threading.Condition()
        self.thread = threading.Thread(target=self.deliver, name=f"mlflow-metrics-{run_id[:8]}", daemon=True)
        self.thread.start()

    @classmethod
    def for_run(cls, run_id: str, tracking_uri: str) -> MetricSender:
        return cls(run_id, sender_for(tracking_uri), where=redact_url(tracking_uri))

    def submit(self, metrics: list[Metric]) -> None:
        """Queue ``metrics`` for delivery; never waits for MLflow."""
        with self.changed:
            self.buffer.extend(metrics)
            self.changed.notify_all()

    @property
    def pending(self) -> int:
        with self.changed:
            return len(self.buffer)

    def next_batch(self) -> list[Metric] | None:
        with self.changed:
            self.changed.wait_for(lambda: self.buffer or self.closing or self.abandoned)
            if self.abandoned or not self.buffer:
                return None
            return list(islice(self.buffer, MAX_BATCH))

    def settle(self, batch: list[Metric], rejected: bool = False) -> None:
        with self.changed:
            for _ in batch:
                self.buffer.popleft()
            if rejected:
                self.rejected.extend(batch)
            self.failures = 0
            self.changed.notify_all()

    def wait_after_failure(self, error: Exception) -> None:
        with self.changed:
            self.failures += 1
            self.last_error = error
            delay = backoff_seconds(self.failures, cap=self.max_backoff)
            if self.failures == 1:
                logger.warning("MLflow metrics of run %s are buffered (%s); retrying", self.run_id, error)
            self.changed.wait_for(lambda: self.abandoned or self.hurry, timeout=delay)
            self.hurry = False

    def deliver(self) -> None:
        while (batch := self.next_batch()) is not None:
            try:
                self.send(self.run_id, batch)
            except MetricsRejected as error:
                self.last_error = error
                self.settle(batch, rejected=True)
            except Exception as error:  # no answer, a timeout, 5xx: the server may be back soon
                self.wait_after_failure(error)
            else:
                self.settle(batch)

    def close(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds (retrying at once, then with the backoff) until every
        metric is delivered; raise :class:`MetricsNotDelivered` if some are not, or were rejected."""
        with self.changed:
            self.closing = self.hurry = True
            self.changed.notify_all()
            drained = self.changed.wait_for(lambda: not self.buffer, timeout=timeout)
            if not drained:
                self.abandoned = True
                self.changed.notify_all()
                left = list(self.buffer)
                raise MetricsNotDelivered(
                    f"MLflow run {self.run_id}: {len(left)} metric values ({steps_of(left)}) not delivered to "
                    f"{self.where} within {timeout:.0f} s: {self.last_error}"
                )
        self.thread.join(timeout=REQUEST_TIMEOUT_S)
        if self.rejected:
            raise MetricsNotDelivered(
                f"MLflow run {self.run_id}: {len(self.rejected)} metric values ({steps_of(self.rejected)}) "
                f"rejected: {self.last_error}"
            )
