"""The launch seam's values: a launch spec survives its JSON file as the same typed job (its stage's
own section type included), a stage folder's layout, and the first failed rank's report, raised
as the task's error."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from infra.core.config import ComputeConfig, EvaluationConfig, ExperimentConfig, ReferenceConfig
from infra.core.fingerprints import atomic_directory
from infra.core.handles import ModelHandle, PreparedData
from infra.core.launching import Finished
from infra.core.stage_io import EvaluatedModel, EvaluateJob, StageFolder, TrainInputs, TrainJob, read_spec
from tasks.evaluate import Scoring, evaluate_job
from tasks.launch import REPEATING_ERRORS, untracked_train_job
from tasks.machine import LaunchFailed, failure
from tasks.metric_sender import MetricsNotDelivered
from tasks.reference import cache_ref_logps, reference_cache_key, reference_job, reference_key
from tasks.train import worth_retrying
from trainers.dpo.section import DPOStageConfig
from trainers.runtime.launched_process import RankError
from trainers.runtime.non_finite import NonFiniteTraining
from trainers.scoring.metrics import ModelScores
from trainers.scoring.reference_views import REFERENCE_VIEWS

pytestmark = pytest.mark.unit


def train_job(tmp_path: Path) -> TrainJob:
    policy = ModelHandle(path=str(tmp_path / "sft"), fingerprint="f", tokenizer_fingerprint="t", stage="sft")
    data = PreparedData(
        path=str(tmp_path / "data"), fingerprint="d", rows={}, dropped={}, token_fingerprints={}, truncation={}
    )
    folder = StageFolder(path=tmp_path / "dpo-abc")
    return TrainJob(
        plugins=(),
        launch_dir=folder.launch_dir,
        stage="dpo",
        section=DPOStageConfig(beta=0.25, loss_type=["sigmoid", "sft"]),
        inputs=TrainInputs(policy, data, compute=ComputeConfig(cpu=True, num_processes=2)),
        folder=folder,
        model_dir=tmp_path / "dpo-abc" / ".model.tmp-1",
        run_id="run-1",
        log_checkpoints="final",
        checkpoint=tmp_path / "dpo-abc" / "checkpoint-4",
        final=False,
    )


def test_a_train_job_reads_back_as_the_same_job_with_its_stages_section_type(tmp_path):
    job = train_job(tmp_path)
    job.launch_dir.mkdir(parents=True)
    job.spec_file.write_text(job.model_dump_json())
    read = read_spec(job.spec_file)
    assert read == job
    assert type(read.section) is DPOStageConfig and (read.section.beta, read.section.loss_type) == (
        0.25,
        ["sigmoid", "sft"],
    )
    assert read.world_size == 2 and read.spec_file == tmp_path / "dpo-abc" / "launch" / "spec.json"


def test_a_spec_missing_a_field_or_with_an_unknown_one_is_refused(tmp_path):
    spec = json.loads(train_job(tmp_path).model_dump_json())
    (tmp_path / "spec.json").write_text(json.dumps({k: v for k, v in spec.items() if k != "final"}))
    with pytest.raises(ValidationError, match=r"train\.final\n  Field required"):
        read_spec(tmp_path / "spec.json")
    (tmp_path / "spec.json").write_text(json.dumps(spec | {"world_size": 2}))
    with pytest.raises(ValidationError, match=r"train\.world_size\n  Extra inputs are not permitted"):
        read_spec(tmp_path / "spec.json")


def test_an_evaluate_job_needs_its_beta_and_its_result_keeps_a_nan_metric(tmp_path):
    models = [EvaluatedModel(model="m", revision=None, pairs=True)]
    fields = dict(plugins=(), launch_dir=tmp_path, models=models, splits=tmp_path, compute=ComputeConfig())
    with pytest.raises(ValidationError, match=r"beta\n  Field required"):
        EvaluateJob(**fields, evaluation=EvaluationConfig())
    job = EvaluateJob(**fields, evaluation=EvaluationConfig(), beta=None)
    assert job.world_size == 1
    scores = [ModelScores({"rewards/margins": math.nan, "greedy_accuracy": 0.5}, {}, {}), ModelScores({}, {}, {})]
    read = job.result.model_validate_json(job.result(world_size=1, scores=scores).model_dump_json()).scores
    assert math.isnan(read[0].metrics["rewards/margins"]) and read[0].metrics["greedy_accuracy"] == 0.5
    assert read[1] == scores[1]


def test_an_evaluate_job_launches_its_models_together_on_either_backend(tmp_path):
    models = [EvaluatedModel(model=name, revision=None, pairs=False) for name in ("base", "sft")]
    fields = dict(plugins=(), launch_dir=tmp_path, models=models, splits=tmp_path, compute=ComputeConfig(), beta=None)
    for backend in ("hf", "vllm"):  # on vLLM a launch ends at a model of another shape (tests/test_vllm.py)
        job = EvaluateJob(**fields, evaluation=EvaluationConfig(generation_backend=backend))
        assert [m.model for m in job.models] == ["base", "sft"]
    with pytest.raises(ValidationError, match=r"models\n  List should have at least 1 item"):
        EvaluateJob(**(fields | {"models": []}), evaluation=EvaluationConfig())


# A plugin that registers a reference view (the pairs, chosen and rejected swapped): a rank that
# does not import it cannot score that view.
VIEW_PLUGIN = """
import dataclasses

from trainers.scoring.reference_views import PAIRS_VIEW, register_view

register_view(dataclasses.replace(PAIRS_VIEW, name="stage_io_swapped", completions=("rejected_ids", "chosen_ids")))
"""


@pytest.fixture
def view_plugin(tmp_path, monkeypatch):
    """An importable plugin module registering the view ``stage_io_swapped``; removed afterwards."""
    (tmp_path / "alignflow_view_plugin.py").write_text(VIEW_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "alignflow_view_plugin"
    REFERENCE_VIEWS.pop("stage_io_swapped", None)
    sys.modules.pop("alignflow_view_plugin", None)


def forget(plugin: str) -> None:
    """As in a fresh rank's process: the plugin not imported, its view not registered."""
    sys.modules.pop(plugin)
    REFERENCE_VIEWS.pop("stage_io_swapped")


def test_every_launch_spec_carries_the_configs_plugins_which_its_ranks_import(handles, view_plugin, tmp_path):
    from prefect.logging import disable_run_logger

    config = ExperimentConfig.model_validate({"plugins": [view_plugin]})
    plugins = (view_plugin,)
    policy, data, _ = handles
    two = ComputeConfig(cpu=True, num_processes=2)
    with disable_run_logger():  # the session's cache entry of the pairs: read, not computed
        ref = cache_ref_logps.fn(data, policy, ReferenceConfig(batch_size=16), None, two, "pairs", config.plugins)
    assert ref.plugins == plugins
    scoring = Scoring([{"prompt": "1+1="}], None, EvaluationConfig(), None, two, plugins=tuple(config.plugins))
    inputs = TrainInputs(policy, data, compute=two)
    jobs = [
        reference_job(ref),
        evaluate_job([policy], scoring, tmp_path / "evaluate"),
        untracked_train_job("sft", {"max_steps": 1}, inputs, tmp_path / "sft", tuple(config.plugins)),
    ]
    for job in jobs:
        assert job.plugins == plugins, job.job
        job.launch_dir.mkdir(parents=True, exist_ok=True)
        job.spec_file.write_text(job.model_dump_json())
        forget(view_plugin)
        assert read_spec(job.spec_file) == job  # as a rank reads it: the plugin imported first
        assert REFERENCE_VIEWS.lookup("stage_io_swapped").completions == ("rejected_ids", "chosen_ids")
    # the task's cached handle carries the plugins: other plugins, another Prefect cache key (same entry)
    parameters = {"data": data, "reference": policy, "compute": two, "view": "pairs", "plugins": ()}
    assert reference_cache_key(None, parameters) == "reference-" + reference_key(data, policy, "float32", "pairs")
    assert reference_cache_key(None, parameters | {"plugins": config.plugins}) != reference_cache_key(None, parameters)


def test_the_stage_folder_layout(tmp_path, monkeypatch):
    folder = StageFolder(path=tmp_path / "outputs" / "cfg" / "dpo-k1")
    assert [
        p.relative_to(folder.path).as_posix() for p in (folder.model_dir, folder.adapter_dir, folder.finished_file)
    ] == [
        "model",
        "adapter",
        "model.json",
    ]
    assert [p.name for p in (folder.run_id_file, folder.lock_file, folder.launch_dir)] == [
        "mlflow_run_id",
        ".lock",
        "launch",
    ]
    assert folder.recorded_run_id() is None
    for name in ("checkpoint-2", "checkpoint-10", ".model.tmp-ab12", "model"):
        (folder.path / name).mkdir(parents=True)
    folder.run_id_file.write_text("r1\n")
    other = StageFolder(path=tmp_path / "outputs" / "cfg" / "sft-k2")
    other.path.mkdir()
    other.run_id_file.write_text("r2")
    assert [p.name for p in folder.checkpoints()] == ["checkpoint-10", "checkpoint-2"]  # sorted by name
    assert [p.name for p in folder.model_stagings()] == [".model.tmp-ab12"]
    assert [f.path.name for f in StageFolder.under(tmp_path / "outputs")] == ["dpo-k1", "sft-k2"]
    monkeypatch.setenv("ALIGNFLOW_HOME", str(tmp_path))
    assert StageFolder.of("cfg", "dpo", "k1") == folder
    assert StageFolder.of_run("cfg", "dpo", "r1") == folder
    with pytest.raises(FileNotFoundError, match="no sft output folder of MLflow run r1 under outputs/cfg"):
        StageFolder.of_run("cfg", "sft", "r1")


def test_the_first_failed_rank_is_the_one_that_failed_earliest(tmp_path):
    assert RankError.first(tmp_path) is None
    for rank, at in ((0, 20.0), (1, 10.0)):
        report = {"rank": rank, "time": at, "error": "ValueError", "traceback": f"trace {rank}"}
        RankError.path(tmp_path, rank).write_text(json.dumps(report))
    assert RankError.first(tmp_path) == RankError(1, 10.0, "ValueError", "trace 1")


@pytest.mark.parametrize("raised", [NonFiniteTraining, MetricsNotDelivered])
def test_a_rank_error_a_retry_would_repeat_is_raised_as_itself_and_not_retried(tmp_path, raised):
    error = raised.__name__
    report = {"rank": 1, "time": 1.0, "error": error, "traceback": f"Traceback …\n{error}: sft diverged at step 3"}
    RankError.path(tmp_path, 1).write_text(json.dumps(report))
    failed = failure("sft", Finished(1, []), tmp_path, None, REPEATING_ERRORS)
    assert type(failed) is raised and str(failed).startswith(f"sft: rank 1 failed ({error}):\nTraceback …")
    state = SimpleNamespace(result=lambda raise_on_failure: failed)
    assert not worth_retrying(None, None, state)
    RankError.path(tmp_path, 1).write_text(json.dumps(report | {"error": "OutOfMemoryError"}))
    crashed = failure("sft", Finished(1, []), tmp_path, None, REPEATING_ERRORS)
    assert type(crashed) is LaunchFailed
    assert worth_retrying(None, None, SimpleNamespace(result=lambda raise_on_failure: crashed))


def test_a_symlink_at_a_folder_the_pipeline_writes_is_replaced_never_followed(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("secret")
    folder = StageFolder(path=tmp_path / "sft-abc")
    folder.path.mkdir()
    folder.model_dir.symlink_to(outside, target_is_directory=True)  # planted before the stage saves its model
    with atomic_directory(folder.model_dir) as staging:
        (staging / "model.safetensors").write_bytes(b"weights")
    assert not folder.model_dir.is_symlink()
    assert [p.name for p in folder.model_dir.iterdir()] == ["model.safetensors"]
    assert [p.name for p in outside.iterdir()] == ["secret.txt"]  # untouched, and not the stage's model
