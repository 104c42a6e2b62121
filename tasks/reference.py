"""Reference log-probs: one frozen forward pass over a view of the prepared data (the preference
pairs; KTO's completions and KL completions: ``trainers.scoring.reference_views``), stored once per
content key in the shared reference cache (``infra/core/refcache.py``) and reused by every run,
experiment and machine that asks for the same data and reference."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Mapping, Sequence, cast
from uuid import UUID

import datasets
from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.context import TaskRunContext
from prefect.runtime import flow_run, task_run

from infra.core.config import ComputeConfig, ReferenceConfig, compute_device
from infra.core.fingerprints import code_fingerprint, hash_value
from infra.core.handles import ModelHandle, PreparedData, ReferenceLogps
from infra.core.refcache import CacheEntry, CacheIntegrityError, Columns
from infra.core.settings import get_settings
from infra.core.stage_io import ReferenceJob
from tasks.caching import computed_once
from tasks.launch import launch
from tasks.mlflow_runs import log_dataset_input, log_metrics
from tasks.reference_columns import joined_splits, reference_store
from tasks.results import CACHED_RESULT, checked_cache_key
from trainers.catalog import REFERENCE_VIEWS
from trainers.models.devices import load_dtype, model_dtype

MLFLOW_SCHEMA = {"row_id": "long", "ref_chosen_logps": "float", "ref_rejected_logps": "float"}
PROGRESS_STEP = 5.0  # percent between updates of the Prefect progress artifact


def reference_key_inputs(
    data: PreparedData, reference: ModelHandle, dtype: str = "float32", view: str = "pairs"
) -> dict:
    """Everything that changes the values and nothing else (no run names, no hyper-parameters).
    ``dtype`` is the one the reference forward runs in (:func:`reference_dtype`); the pass checks
    it against the loaded model's parameters. ``view`` names what is scored: the rows it builds
    (KTO's KL pairs, a plugin's view) come from the modules of its functions, which the ``code``
    digest covers with this one's."""
    scored = REFERENCE_VIEWS.lookup(view)
    return {
        "view": view,
        "splits": {
            split: data.token_fingerprints[split] for split in scored.sources if split in data.token_fingerprints
        },
        "truncation": data.truncation,
        "weights": reference.weights_fingerprint or reference.fingerprint,  # hub models: id + revision
        "tokenizer": reference.tokenizer_fingerprint,
        # this module and the trainers code it runs (log-probs, collators, loading), and the view's
        "code": code_fingerprint(__name__, *sorted({scored.splits.__module__, scored.rows.__module__})),
        "dtype": dtype,
    }


def reference_key(data: PreparedData, reference: ModelHandle, dtype: str = "float32", view: str = "pairs") -> str:
    return hash_value(reference_key_inputs(data, reference, dtype, view))


def reference_dtype(reference: ModelHandle, compute: ComputeConfig) -> str:
    """The dtype the reference is loaded, and its forward run, in: ``compute.dtype``, or the
    checkpoint's own for ``auto``."""
    return load_dtype(reference.path, reference.revision, compute.dtype)


def reference_cache_key(context, parameters) -> str:
    """``parameters`` holds every argument of the call, defaults applied (Prefect binds them so). The
    handle it caches carries the plugins a launched pass imports: other plugins, another handle (the
    same cache entry)."""
    data, reference = parameters["data"], parameters["reference"]
    dtype = reference_dtype(reference, parameters["compute"])
    key = reference_key(data, reference, dtype, parameters["view"])
    plugins = tuple(parameters["plugins"])
    return "reference-" + (hash_value([key, plugins]) if plugins else key)  # without plugins: as it was


class PrefectProgress:
    """Progress of the reference pass as a Prefect progress artifact (inside a task run only)."""

    def __init__(self, total: int):
        self.total, self.done, self.shown = total, 0, 0.0
        in_task = TaskRunContext.get() is not None
        # in a sync function the artifact's id, not a coroutine (async_dispatch's return type covers both)
        self.artifact_id = (
            cast(UUID, create_progress_artifact(0.0, description=f"reference log-probs of {total} rows"))
            if in_task
            else None
        )

    def __call__(self, rows: int) -> None:
        self.done += rows
        percent = 100.0 * self.done / self.total
        if self.artifact_id is not None and (percent - self.shown >= PROGRESS_STEP or self.done == self.total):
            update_progress_artifact(self.artifact_id, percent)
            self.shown = percent


def compute_columns(ref: ReferenceLogps) -> Mapping[str, Columns]:
    """Reference log-probs of every split of ``ref.view`` in row order (row id = position in the split),
    in ``ref.dtype`` (the dtype of its key, which must be the loaded model's), on this machine's GPU
    where there is one (unless ``compute.cpu``), or launched over ``compute.num_processes``."""
    if ref.compute.num_processes > 1:
        return launched_columns(ref)
    from trainers.models.pretrained import load_causal_lm
    from trainers.scoring.reference_pass import score_view

    view = REFERENCE_VIEWS.lookup(ref.view)
    reference = ref.reference
    model, tokenizer = load_causal_lm(reference.path, reference.revision, ref.dtype, compute_device(ref.compute.cpu))
    if model_dtype(model) != ref.dtype:
        raise CacheIntegrityError(
            f"reference {reference.path} loaded in {model_dtype(model)}, but its cache key says {ref.dtype}"
        )
    progress = PrefectProgress(sum(view.rows(ref.data.rows).values()))
    prepared = datasets.load_from_disk(ref.data.path)
    return score_view(
        model,
        tokenizer.pad_token_id,
        view,
        prepared,
        ref.batch_size,
        on_batch=progress,
        padding_free=ref.compute.padding_free,
    )


def reference_job(ref: ReferenceLogps) -> ReferenceJob:
    """The launched pass of ``ref``: its model, splits, view and processes, and its plugins."""
    return ReferenceJob(
        plugins=ref.plugins,
        launch_dir=get_settings().launches / f"reference-{ref.key}",  # one launch per key: under its lock
        model=ref.reference.path,
        revision=ref.reference.revision,
        splits=Path(ref.data.path),
        compute=ref.compute.model_copy(update={"dtype": ref.dtype}),
        view=ref.view,
        batch_size=ref.batch_size,
    )


def launched_columns(ref: ReferenceLogps) -> Mapping[str, Columns]:
    """:func:`compute_columns` by a :class:`ReferenceJob` over ``ref.compute``'s processes, each
    scoring its share of the batches: the same values as one process (``trainers.runtime.work_split``)."""
    job = reference_job(ref)
    try:
        return launch(job, "reference log-probs").columns
    finally:
        shutil.rmtree(job.launch_dir, ignore_errors=True)


def ensure_entry(ref: ReferenceLogps, mlflow_run_id: str | None = None) -> tuple[CacheEntry, bool]:
    """The verified cache entry of ``ref`` and whether it was computed now (missing, partial or
    corrupt entries are computed, once, under the key's lock)."""
    producer = {
        "mlflow_run_id": mlflow_run_id,
        "prefect_flow_run_id": flow_run.get_id(),
        "prefect_task_run_id": task_run.get_id(),
    }
    return reference_store(ref.root).get_or_compute(
        ref.key,
        lambda: compute_columns(ref),
        inputs=reference_key_inputs(ref.data, ref.reference, ref.dtype, ref.view),
        producer={name: str(value) for name, value in producer.items() if value},
        expected_rows=REFERENCE_VIEWS.lookup(ref.view).rows(ref.data.rows),
    )


def log_reference_input(run_id: str, entry: CacheEntry) -> None:
    """List the cache entry among the run's MLflow input datasets, with its digest and URI."""
    profile = {"key": entry.key, "rows": entry.rows, "created_at": entry.manifest["created_at"]}
    log_dataset_input(run_id, "reference-logps", entry.digest, entry.uri, MLFLOW_SCHEMA, profile, context="training")


def with_reference_columns(ref: ReferenceLogps) -> dict[str, datasets.Dataset | list[dict]]:
    """The view's splits (the prepared preference splits; KTO's rows) with their ``ref_*`` columns
    joined on (``ref_chosen_logps`` / ``ref_rejected_logps``; ``ref_logps`` / ``ref_kl_logps``); a
    missing or corrupt entry is computed first (:func:`ensure_entry`)."""
    entry, _ = ensure_entry(ref)
    return joined_splits(ref, entry)


@task(
    name="cache-reference-logps",
    cache_policy=computed_once(checked_cache_key(reference_cache_key)),  # concurrent identical runs: once
    **CACHED_RESULT,
)
def cache_ref_logps(
    data: PreparedData,
    reference: ModelHandle,
    config: ReferenceConfig,
    parent_run_id: str | None = None,
    compute: ComputeConfig = ComputeConfig(),  # noqa: B008 (frozen)
    view: str = "pairs",
    plugins: Sequence[str] = (),
) -> ReferenceLogps:
    """Reference log-probs of every row of ``view`` (the preference pairs by default): read from the
    cache, or computed into it once (device, dtype and processes from ``compute``; a launched pass
    imports ``plugins``, the config's, first). Logs the stage's wall time and rows/s to the parent
    MLflow run."""
    dtype = reference_dtype(reference, compute)
    ref = ReferenceLogps(
        key=reference_key(data, reference, dtype, view),
        root=reference_store().root,
        data=data,
        reference=reference,
        batch_size=config.batch_size,
        dtype=dtype,
        compute=compute,
        view=view,
        plugins=tuple(plugins),
    )
    started = time.perf_counter()
    entry, computed = ensure_entry(ref, parent_run_id)
    seconds = time.perf_counter() - started
    rows = sum(entry.rows.values())
    get_run_logger().info(
        "reference log-probs of %d rows (%s) %s %s in %.2f s",
        rows,
        view,
        "computed into" if computed else "read from",
        entry.uri,
        seconds,
    )
    if parent_run_id is not None:
        # by view: one run may have several reference passes (KTO's rows, then its held-out pairs)
        metrics = {"seconds": seconds, "rows": rows, "rows_per_second": rows / seconds, "computed": float(computed)}
        log_metrics(parent_run_id, {f"reference/{view}/{name}": value for name, value in metrics.items()})
    return ref
