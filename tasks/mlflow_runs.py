"""MLflow runs without Prefect: the client, experiments, params, metrics and dataset inputs, and a
run's page. The ranks of a launched stage log through these (rank 0 into the stage's run) and import
no Prefect; :mod:`tasks.tracking` adds the flow run's side (parent runs, process records, resumes).

Every call names its run id explicitly: tasks may run in worker threads, where MLflow's fluent
"active run" is not visible.
"""

from __future__ import annotations

import json
import math
import re
import time

from mlflow import MlflowClient
from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param
from mlflow.exceptions import MlflowException

from infra.core.mlflow_compat import DATASET_CONTEXT_TAG
from infra.core.settings import get_settings, redact_url

MAX_BATCH = 100


def client() -> MlflowClient:
    return MlflowClient(get_settings().mlflow_tracking_uri)


def experiment_id(name: str) -> str:
    """The experiment's id, created if missing (by this process or, at the same moment, another)."""
    found = client().get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    root = get_settings().mlflow_artifact_location
    # the name as a folder below the artifact root, and never out of it (a name may hold / or ..)
    folder = re.sub(r"[^A-Za-z0-9_-]", "_", name)
    try:
        return client().create_experiment(name, artifact_location=f"{root}/{folder}" if root else None)
    except MlflowException as error:
        if error.error_code != "RESOURCE_ALREADY_EXISTS" or (found := client().get_experiment_by_name(name)) is None:
            raise
        return found.experiment_id


def log_params(run_id: str, params: dict) -> None:
    items = [Param(k, str(v)[:6000]) for k, v in params.items()]
    for start in range(0, len(items), MAX_BATCH):
        client().log_batch(run_id, params=items[start : start + MAX_BATCH])


def log_new_params(run_id: str, params: dict) -> None:
    """Log those of ``params`` the run has not: MLflow params cannot change, and a resumed run keeps
    those its first attempt logged (its ``policy.init`` may name another copy of the state folder)."""
    logged = client().get_run(run_id).data.params
    log_params(run_id, {k: v for k, v in params.items() if k not in logged})


def metric_values(metrics: dict, step: int) -> list[Metric]:
    """The finite numbers of ``metrics`` as MLflow metrics at ``step``, stamped now; other values
    (text, tables, NaN, infinities) are left out."""
    now = int(time.time() * 1000)
    return [
        Metric(k, float(v), now, step) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)
    ]


def log_metrics(run_id: str, metrics: dict[str, float], step: int = 0) -> None:
    items = metric_values(metrics, step)
    for start in range(0, len(items), MAX_BATCH):
        client().log_batch(run_id, metrics=items[start : start + MAX_BATCH])


def log_dataset_input(
    run_id: str, name: str, digest: str, uri: str, schema: dict[str, str], profile: dict, context: str
) -> None:
    """Record a dataset as an input of the run (MLflow's *Datasets used*): its digest, where it
    lives (``uri``), its columns (``schema``: name -> MLflow type) and a small ``profile``."""
    scheme = uri.split("://", 1)[0] if "://" in uri else "local"
    dataset = Dataset(
        name=name,
        digest=digest,
        source_type="local" if scheme == "file" else scheme,
        source=json.dumps({"uri": uri}),
        schema=json.dumps({"mlflow_colspec": [{"name": column, "type": kind} for column, kind in schema.items()]}),
        profile=json.dumps(profile),
    )
    client().log_inputs(run_id, datasets=[DatasetInput(dataset, tags=[InputTag(DATASET_CONTEXT_TAG, context)])])


# MLflow 3's UI opens an experiment on its GenAI (traces) view unless asked for the runs view.
RUNS_VIEW = "?workflowType=machine_learning"


def mlflow_run_url(experiment: str, run_id: str) -> str:
    """The run's page in the MLflow UI, credentials redacted: it is stored in Prefect (link artifacts)."""
    return redact_url(f"{get_settings().mlflow_ui}/#/experiments/{experiment}/runs/{run_id}{RUNS_VIEW}")
