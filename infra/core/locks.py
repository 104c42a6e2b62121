"""Cross-process locks for shared caches: a kernel file lock on local paths, a lease elsewhere.

``LocalFileLock`` (``fcntl.flock``) is released by the kernel when its holder exits or is
killed, so a crashed holder never leaves a stale lock behind. ``LeaseLock`` serves fsspec
stores without file locks (object stores, ``memory://``): the lock file is created
exclusively (mode ``"xb"``) and its holder rewrites a heartbeat into it every
``lease_seconds / 3``; a waiter breaks a lock whose heartbeat is older than ``lease_seconds``.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from pathlib import Path

logger = logging.getLogger("alignflow.locks")

POLL_SECONDS = 0.1


def holder_info() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}


class LockTimeout(TimeoutError):
    """Waited longer than the lock's timeout; the message names the lock file and its holder."""


class LocalFileLock:
    def __init__(self, path: str | Path, timeout: float):
        self.path = Path(path)
        self.timeout = timeout
        self.fd: int | None = None

    def __enter__(self) -> LocalFileLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    holder = self.path.read_text(errors="replace").strip() or "unknown"
                    os.close(fd)
                    raise LockTimeout(f"{self.path}: still locked after {self.timeout:.0f} s by {holder}") from None
                time.sleep(POLL_SECONDS)
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(holder_info()).encode())  # for people and for timeout messages only
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is None:
            raise RuntimeError(f"{self.path}: released but not held")
        os.ftruncate(self.fd, 0)
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None


class LeaseLock:
    def __init__(self, fs, path: str, timeout: float, lease_seconds: float = 120.0):
        self.fs, self.path = fs, path
        self.timeout, self.lease_seconds = timeout, lease_seconds
        self.token = uuid.uuid4().hex
        self.stop = threading.Event()
        self.heartbeat: threading.Thread | None = None

    def record(self) -> bytes:
        return json.dumps({**holder_info(), "token": self.token, "heartbeat": time.time()}).encode()

    def read_holder(self) -> dict | None:
        try:
            return json.loads(self.fs.cat_file(self.path))
        except FileNotFoundError:
            return None
        except ValueError:  # being written right now, or garbage: judge it by age next time
            return {"heartbeat": time.time()}

    def try_create(self) -> bool:
        try:
            with self.fs.open(self.path, "xb") as handle:
                handle.write(self.record())
            return True
        except FileExistsError:
            return False

    def __enter__(self) -> LeaseLock:
        self.fs.makedirs(self.path.rsplit("/", 1)[0], exist_ok=True)
        deadline = time.monotonic() + self.timeout
        while not self.try_create():
            holder = self.read_holder()
            if holder is not None and time.time() - holder["heartbeat"] > self.lease_seconds:
                logger.warning(
                    "breaking stale lock %s (no heartbeat for %.0f s): %s",
                    self.path,
                    time.time() - holder["heartbeat"],
                    holder,
                )
                self.fs.rm_file(self.path)
                continue
            if time.monotonic() > deadline:
                raise LockTimeout(f"{self.path}: still locked after {self.timeout:.0f} s by {holder}")
            time.sleep(POLL_SECONDS)
        self.heartbeat = threading.Thread(target=self.beat, name=f"lease-{self.path}", daemon=True)
        self.heartbeat.start()
        return self

    def beat(self) -> None:
        while not self.stop.wait(self.lease_seconds / 3):
            self.fs.pipe_file(self.path, self.record())

    def __exit__(self, *exc) -> None:
        if self.heartbeat is None:
            raise RuntimeError(f"{self.path}: released but not held")
        self.stop.set()
        self.heartbeat.join()
        holder = self.read_holder()
        if holder is not None and holder.get("token") == self.token:
            self.fs.rm_file(self.path)


class TaskLockManager:
    """Prefect's lock-manager protocol (``prefect.locking.protocol.LockManager``) on kernel file
    locks: a cached task with ``isolation_level="SERIALIZABLE"`` holds its cache key's lock while
    it computes, so a second run with the same key, in any process that shares the folder, waits
    and then reads the cached result instead of computing it again. A holder that dies releases
    its lock with its file descriptors (Prefect's file lock manager would leave a lock file that
    blocks every later run). ``folder`` is a callable so that a pickled manager (a task sent to a
    Dask worker) resolves it in the worker's settings."""

    def __init__(self, folder):
        self.folder = folder
        self.held: dict[str, tuple[str, LocalFileLock]] = {}

    def __getstate__(self) -> dict:
        return {"folder": self.folder, "held": {}}  # locks belong to their process

    def lock(self, key: str, timeout: float | None) -> LocalFileLock:
        return LocalFileLock(Path(self.folder()) / f"{key}.lock", math.inf if timeout is None else timeout)

    def acquire_lock(self, key: str, holder: str, acquire_timeout=None, hold_timeout=None) -> bool:
        if self.is_lock_holder(key, holder):
            return True
        lock = self.lock(key, acquire_timeout)
        try:
            lock.__enter__()
        except LockTimeout:
            return False
        self.held[key] = (holder, lock)
        return True

    def release_lock(self, key: str, holder: str) -> None:
        if not self.is_lock_holder(key, holder):
            raise ValueError(f"{holder} does not hold the lock of {key}")
        _, lock = self.held.pop(key)
        lock.__exit__(None, None, None)

    def is_locked(self, key: str) -> bool:
        return key in self.held or not self.wait_for_lock(key, 0)

    def is_lock_holder(self, key: str, holder: str) -> bool:
        return key in self.held and self.held[key][0] == holder

    def wait_for_lock(self, key: str, timeout: float | None = None) -> bool:
        try:
            with self.lock(key, timeout):
                return True
        except LockTimeout:
            return False

    async def aacquire_lock(self, key: str, holder: str, acquire_timeout=None, hold_timeout=None) -> bool:
        return self.acquire_lock(key, holder, acquire_timeout, hold_timeout)

    async def await_for_lock(self, key: str, timeout: float | None = None) -> bool:
        return self.wait_for_lock(key, timeout)
