"""The reference log-prob store on its own: layout, integrity, locking, maintenance (no Prefect)."""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace

import fsspec
import numpy as np
import pytest

from infra.core.locks import LeaseLock, LocalFileLock, LockTimeout
from infra.core.refcache import CacheIntegrityError, ReferenceCache, parse_duration

CHOSEN = [-1.5, -0.25, -3.0, -7.125]
REJECTED = [-2.5, -4.0, -0.5, -9.0]
EVAL = ([-1.0, -2.0], [-3.0, -0.75])


class Counter:
    """A compute function that counts its calls."""

    def __init__(self, values=None):
        self.calls = 0
        self.values = values or {"preference": (CHOSEN, REJECTED), "preference_eval": EVAL}

    def __call__(self):
        self.calls += 1
        return self.values


@pytest.fixture(params=["path", "file-url", "memory"])
def store(request, tmp_path) -> ReferenceCache:
    roots = {
        "path": str(tmp_path / "refcache"),
        "file-url": (tmp_path / "refcache").as_uri(),
        "memory": f"memory://refcache-{uuid.uuid4().hex}",
    }
    return ReferenceCache(roots[request.param])


@pytest.mark.unit
def test_entry_is_written_once_with_manifest_checksums_and_read_back(store, monkeypatch):
    from infra.core import refcache

    clock = iter([10.0, 11.5])  # the computation's start and end: 1.5 s for its 6 pairs
    monkeypatch.setattr(refcache, "time", SimpleNamespace(perf_counter=lambda: next(clock)))  # its clock only
    compute = Counter()
    entry, computed = store.get_or_compute(
        "k1", compute, inputs={"weights": "abc"}, producer={"mlflow_run_id": "run-1"}
    )
    assert computed and compute.calls == 1
    assert entry.tables["preference"].column("ref_chosen_logps").to_pylist() == CHOSEN
    assert entry.tables["preference_eval"].column("ref_rejected_logps").to_pylist() == EVAL[1]
    assert entry.tables["preference"].column("row_id").to_pylist() == [0, 1, 2, 3]

    manifest = json.loads(store.fs.cat_file(f"{store.base}/k1/manifest.json"))
    assert manifest["inputs"] == {"weights": "abc"}
    assert manifest["producer"]["mlflow_run_id"] == "run-1" and manifest["producer"]["pid"] == os.getpid()
    for split, rows in {"preference": 4, "preference_eval": 2}.items():
        data = store.fs.cat_file(f"{store.base}/k1/{split}.parquet")
        assert manifest["splits"][split] == {
            "file": f"{split}.parquet",
            "rows": rows,
            "sha256": hashlib.sha256(data).hexdigest(),
        }
    assert manifest["timing"] == {"compute_seconds": 1.5, "rows": 6, "rows_per_second": 4.0}
    assert datetime.now(timezone.utc) - datetime.fromisoformat(manifest["created_at"]) < timedelta(minutes=5)
    assert entry.digest == manifest["digest"] and entry.uri == f"{store.root}/k1"

    again, computed = store.get_or_compute("k1", compute, inputs={"weights": "abc"})
    assert not computed and compute.calls == 1
    assert again.digest == entry.digest
    assert store.keys() == ["k1"]  # no staging folder or lock listed as an entry
    assert not store.fs.exists(f"{store.base}/.staging") or store.fs.ls(f"{store.base}/.staging") == []


def flip_a_byte(fs, path):
    data = bytearray(fs.cat_file(path))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(path, bytes(data))


DAMAGE = {
    "parquet-byte-flipped": lambda fs, e: flip_a_byte(fs, f"{e}/preference.parquet"),
    "parquet-truncated": lambda fs, e: fs.pipe_file(
        f"{e}/preference.parquet", fs.cat_file(f"{e}/preference.parquet")[:100]
    ),
    "parquet-deleted": lambda fs, e: fs.rm_file(f"{e}/preference_eval.parquet"),
    "manifest-deleted": lambda fs, e: fs.rm_file(f"{e}/manifest.json"),
    "manifest-cut": lambda fs, e: fs.pipe_file(f"{e}/manifest.json", fs.cat_file(f"{e}/manifest.json")[:50]),
}


@pytest.mark.unit
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_corrupt_or_partial_entry_is_detected_and_rebuilt_with_a_warning(store, damage, caplog):
    compute = Counter()
    first, _ = store.get_or_compute("k1", compute, inputs={})
    DAMAGE[damage](store.fs, f"{store.base}/k1")
    with pytest.raises(CacheIntegrityError, match=f"{store.root}/k1/"):
        store.read("k1")

    with caplog.at_level(logging.WARNING, logger="alignflow.refcache"):
        rebuilt, computed = store.get_or_compute("k1", compute, inputs={})
    assert computed and compute.calls == 2
    assert "k1 is unusable and will be rebuilt" in caplog.text
    assert rebuilt.tables["preference"].column("ref_chosen_logps").to_pylist() == CHOSEN
    assert rebuilt.digest == first.digest  # same values, same bytes
    assert store.read("k1").digest == first.digest


@pytest.mark.unit
def test_entry_whose_rows_differ_from_the_prepared_data_is_rebuilt(tmp_path):
    store = ReferenceCache(str(tmp_path))
    store.get_or_compute("k1", Counter({"preference": (CHOSEN[:3], REJECTED[:3])}), inputs={})
    compute = Counter()
    entry, computed = store.get_or_compute(
        "k1", compute, inputs={}, expected_rows={"preference": 4, "preference_eval": 2}
    )
    assert computed and compute.calls == 1 and entry.rows == {"preference": 4, "preference_eval": 2}


@pytest.mark.unit
def test_failed_computation_leaves_no_entry_and_no_staging(tmp_path):
    store = ReferenceCache(str(tmp_path))

    def mismatched():
        return {"preference": ([-1.0, -2.0], [-1.0])}

    with pytest.raises(ValueError, match="2 chosen but 1 rejected"):
        store.get_or_compute("k1", mismatched, inputs={})
    assert store.keys() == [] and list((tmp_path / ".staging").iterdir()) == []


def request_entry(root: str, barrier, calls_file: str, results) -> None:
    """One of two processes asking for the same key at the same moment."""

    def compute():
        with open(calls_file, "a") as handle:
            handle.write(f"{os.getpid()}\n")
        time.sleep(1.0)  # hold the lock while the other process arrives
        rng = random.Random(os.getpid())  # values unique to this process: two computations would differ
        return {"preference": ([rng.random() for _ in range(20)], [rng.random() for _ in range(20)])}

    barrier.wait()
    entry, computed = ReferenceCache(root).get_or_compute("shared-key", compute, inputs={})
    results.put((computed, entry.digest, entry.tables["preference"].column("ref_chosen_logps").to_pylist()))
    results.close()
    results.join_thread()  # the outcome is in the pipe
    # No interpreter teardown, as the product's processes end (trainers/runtime/fast_exit.py): pyarrow's C++
    # threads now and then abort it ("terminate called without an active exception", SIGABRT).
    os._exit(0)


@pytest.mark.slow
def test_two_processes_requesting_one_key_compute_it_once_and_read_the_same_values(tmp_path):
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(2), context.Queue()
    calls_file = tmp_path / "calls.txt"
    processes = [
        context.Process(target=request_entry, args=(str(tmp_path / "cache"), barrier, str(calls_file), results))
        for _ in range(2)
    ]
    for process in processes:
        process.start()
    outcomes = [results.get(timeout=120) for _ in processes]
    for process in processes:
        process.join(timeout=30)
        assert process.exitcode == 0
    assert len(calls_file.read_text().split()) == 1
    assert sorted(computed for computed, _, _ in outcomes) == [False, True]
    assert outcomes[0][1:] == outcomes[1][1:]


@pytest.mark.unit
def test_two_threads_on_a_memory_store_compute_once_through_the_lease_lock():
    store = ReferenceCache(f"memory://lease-{uuid.uuid4().hex}", lease_seconds=0.3)
    calls, outcomes = [], []

    def compute():
        calls.append(threading.get_ident())
        time.sleep(1.0)  # several leases long: only the heartbeat keeps the lock
        return {"preference": ([float(threading.get_ident() % 1000)], [0.0])}

    def request():
        entry, _ = store.get_or_compute("k", compute, inputs={})
        outcomes.append(entry.tables["preference"].to_pydict())

    threads = [threading.Thread(target=request) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and outcomes[0] == outcomes[1]


HOLD_LOCK = (
    "import sys, time; from infra.core.locks import LocalFileLock; lock = LocalFileLock(sys.argv[1], 5).__enter__(); "
    "print('locked', flush=True); time.sleep(120)"
)


@pytest.mark.slow
def test_local_lock_of_a_killed_holder_is_free_at_once(tmp_path):
    path = tmp_path / "locks" / "k.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(path)], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1]
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(LockTimeout, match=f'{path}: still locked .* "pid": {holder.pid}'):
            with LocalFileLock(path, timeout=0.3):
                pass
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=10)
        with LocalFileLock(path, timeout=5):
            assert json.loads(path.read_text())["pid"] == os.getpid()
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.unit
def test_lease_lock_breaks_a_stale_lease_and_times_out_on_a_live_one(caplog):
    fs = fsspec.filesystem("memory")
    path = f"/leases-{uuid.uuid4().hex}/k.lock"
    fs.pipe_file(path, json.dumps({"host": "gone", "pid": 1, "heartbeat": time.time() - 3600, "token": "old"}).encode())
    with caplog.at_level(logging.WARNING, logger="alignflow.locks"):
        with LeaseLock(fs, path, timeout=5, lease_seconds=60) as lock:
            assert "breaking stale lock" in caplog.text
            assert json.loads(fs.cat_file(path))["token"] == lock.token
            with pytest.raises(LockTimeout, match=f"{path}: still locked"):
                with LeaseLock(fs, path, timeout=0.3, lease_seconds=60):
                    pass
    assert not fs.exists(path)


def age_entry(store: ReferenceCache, key: str, days: float) -> None:
    path = f"{store.base}/{key}/manifest.json"
    manifest = json.loads(store.fs.cat_file(path))
    manifest["created_at"] = (datetime.now(timezone.utc) - timedelta(days=days)).isoformat()
    store.fs.pipe_file(path, json.dumps(manifest).encode())


@pytest.mark.unit
def test_gc_removes_entries_and_staging_older_than_the_limit(tmp_path):
    store = ReferenceCache(str(tmp_path))
    for key in ("old", "new"):
        store.get_or_compute(key, Counter(), inputs={})
    age_entry(store, "old", days=8)
    abandoned = tmp_path / ".staging" / f"k.{int(time.time() - 9 * 86400)}.abcd1234"
    abandoned.mkdir(parents=True)
    assert store.gc(parse_duration("7d"), dry_run=True) == ["old", f".staging/{abandoned.name}"]
    assert store.keys() == ["new", "old"]
    assert store.gc(parse_duration("7d")) == ["old", f".staging/{abandoned.name}"]
    assert store.keys() == ["new"] and not abandoned.exists()
    assert store.read("new").rows == {"preference": 4, "preference_eval": 2}


@pytest.mark.unit
def test_parse_duration():
    assert parse_duration("7d") == timedelta(days=7)
    assert parse_duration("12h") == timedelta(hours=12)
    assert parse_duration("1.5w") == timedelta(weeks=1.5)
    with pytest.raises(ValueError, match="duration '7 days'"):
        parse_duration("7 days")


@pytest.mark.unit
def test_cache_cli_ls_show_verify_gc(tmp_path, capsys):
    from infra.ops.cli import main

    store = ReferenceCache(str(tmp_path))
    for key in ("aaa111", "bbb222", "ccc333"):
        store.get_or_compute(key, Counter(), inputs={"key": key})
    age_entry(store, "ccc333", days=30)
    flip_a_byte(store.fs, f"{store.base}/bbb222/preference.parquet")
    root = ["--root", str(tmp_path)]

    assert main(["cache", "ls", *root]) == 0
    listing = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listing[1:]] == ["aaa111", "bbb222", "ccc333"]
    assert "4+2" in listing[1]

    assert main(["cache", "show", "aaa", *root]) == 0  # a unique key prefix is enough
    shown = capsys.readouterr().out
    assert json.loads(shown[: shown.rindex("}") + 1])["digest"] == store.read("aaa111").digest
    assert "verified: ok" in shown

    assert main(["cache", "verify", *root]) == 1
    verdicts = capsys.readouterr().out
    assert "aaa111  ok" in verdicts and "ccc333  ok" in verdicts
    assert "bbb222  CORRUPT" in verdicts and "sha256" in verdicts

    assert main(["cache", "verify", "--delete", *root]) == 1
    capsys.readouterr()
    assert store.keys() == ["aaa111", "ccc333"]

    assert main(["cache", "gc", "--older-than", "7d", *root]) == 0
    assert "ccc333" in capsys.readouterr().out
    assert store.keys() == ["aaa111"]
    assert main(["cache", "show", "zzz", *root]) == 1


@pytest.mark.unit
def test_values_survive_as_float32():
    """float32 log-probs (what the reference pass produces) are stored without rounding."""
    values = np.float32([-1.2345678, -0.1, -33.3]).tolist()
    store = ReferenceCache(f"memory://f32-{uuid.uuid4().hex}")
    entry, _ = store.get_or_compute("k", Counter({"preference": (values, values)}), inputs={})
    assert entry.tables["preference"].column("ref_chosen_logps").to_pylist() == values
