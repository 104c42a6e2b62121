"""Storage retention: a finished stage's checkpoints are pruned, and ``alignflow gc`` removes what
no live run or registry version needs (plan by hand; then real runs, a real registry version)."""

from __future__ import annotations

import re
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from helpers import environment_without_services

from infra.core.stage_io import StageFolder
from infra.core.storage import Removal, RunFacts, StageRecord, plan_removals, prune_checkpoints, stage_folders

RUN_ID_FILE = StageFolder.RUN_ID

PROJECT = Path(__file__).parents[1]
NOW = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)


def folder(tmp_path: Path, name: str, status: str, days_old: float, stage="sft", config="c", trial=None) -> StageRecord:
    path = tmp_path / config / name / stage
    (path / "checkpoint-3").mkdir(parents=True)
    (path / "model").mkdir()
    return StageRecord(path, f"run-{name}", config, stage, status, NOW - timedelta(days=days_old), trial)


@pytest.mark.unit
def test_prune_checkpoints_keeps_the_final_model(tmp_path):
    for name in ("checkpoint-3", "checkpoint-6", "model"):
        (tmp_path / name).mkdir()
    (tmp_path / RUN_ID_FILE).write_text("abc")
    assert prune_checkpoints(StageFolder(path=tmp_path)) == [tmp_path / "checkpoint-3", tmp_path / "checkpoint-6"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow_run_id", "model"]


@pytest.mark.unit
def test_plan_keeps_live_runs_the_newest_per_group_and_young_folders(tmp_path):
    old_finished = folder(tmp_path, "a", "FINISHED", days_old=30)
    old_failed = folder(tmp_path, "b", "FAILED", days_old=20)
    newest = folder(tmp_path, "c", "FINISHED", days_old=10)
    live = folder(tmp_path, "d", "RUNNING", days_old=40)  # live: kept whatever its age, not counted in keep_last
    young = folder(tmp_path, "e", "FINISHED", days_old=1, config="other")
    young_older = folder(tmp_path, "f", "FINISHED", days_old=2, config="other")
    dpo = folder(tmp_path, "a", "FAILED", days_old=30, stage="dpo")  # alone in its group: kept, checkpoints too

    plan = plan_removals([old_finished, old_failed, newest, live, young, young_older, dpo], timedelta(days=7), 1, NOW)

    assert plan == [
        Removal(newest.path / "checkpoint-3", "checkpoint of a finished stage", whole_stage=False),
        Removal(old_failed.path, "failed run run-b, superseded", whole_stage=True),
        Removal(old_finished.path, "finished run run-a, superseded", whole_stage=True),
        Removal(young.path / "checkpoint-3", "checkpoint of a finished stage", whole_stage=False),
        Removal(young_older.path / "checkpoint-3", "checkpoint of a finished stage", whole_stage=False),
    ]
    assert plan_removals([old_finished, newest], timedelta(days=7), keep_last=0, now=NOW) == [
        Removal(newest.path, "finished run run-c, superseded", whole_stage=True),
        Removal(old_finished.path, "finished run run-a, superseded", whole_stage=True),
    ]


@pytest.mark.unit
def test_a_sweeps_trials_are_not_versions_of_one_another(tmp_path):
    """Trials share their config name; each keeps its newest folder, and an older run of the same
    config outside the sweep is still superseded by the newer one."""
    trials = [folder(tmp_path, f"t{i}", "FINISHED", days_old=10 + i, stage="dpo", trial=f"trial-{i}") for i in range(3)]
    rerun = folder(tmp_path, "t0-again", "FINISHED", days_old=9, stage="dpo", trial="trial-0")
    plain = [folder(tmp_path, name, "FINISHED", days_old=age, stage="dpo") for name, age in (("p1", 20), ("p2", 8))]
    plan = plan_removals([*trials, rerun, *plain], timedelta(days=7), 1, NOW)
    assert [r for r in plan if r.whole_stage] == [
        Removal(plain[0].path, "finished run run-p1, superseded", whole_stage=True),
        Removal(trials[0].path, "finished run run-t0, superseded", whole_stage=True),
    ]


@pytest.mark.unit
def test_stage_folders_reads_run_ids_config_names_and_stage_tags(tmp_path):
    for flow_run, stage in (("r1", "sft"), ("r2", "dpo")):
        path = tmp_path / "minimal" / flow_run / stage
        path.mkdir(parents=True)
        (path / RUN_ID_FILE).write_text(f"id-{stage}\n")
    facts = {"id-sft": RunFacts("FINISHED", "sft", "trial-1"), "id-dpo": RunFacts("MISSING")}
    found = stage_folders(tmp_path, facts.__getitem__)
    assert [(f.run_id, f.config_name, f.stage, f.status, f.trial_run_id) for f in found] == [
        ("id-sft", "minimal", "sft", "FINISHED", "trial-1"),
        ("id-dpo", "minimal", "dpo", "MISSING", None),
    ]


@pytest.fixture
def fresh_home(tmp_path, prefect_api_url):
    env = {
        **environment_without_services(),
        "ALIGNFLOW_HOME": str(tmp_path),
        "PREFECT_API_URL": prefect_api_url,
        "OMP_NUM_THREADS": "1",
    }

    def alignflow(*args: str) -> str:
        result = subprocess.run(
            [sys.executable, "-m", "infra.ops.cli", *args], cwd=PROJECT, env=env, capture_output=True, text=True
        )
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout + result.stderr

    return tmp_path, alignflow


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.flow
def test_gc_removes_superseded_outputs_and_mlflow_checkpoints_but_keeps_live_runs_and_the_registry(fresh_home):
    from mlflow import MlflowClient
    from mlflow.artifacts import download_artifacts
    from transformers import AutoModelForCausalLM

    home, alignflow = fresh_home
    # six SFT steps score 0: no floor, so that the run registers a version
    base = [
        "run",
        "configs/minimal.yaml",
        "stages=[sft]",
        "promotion.registered_model=gc-model",
        "promotion.min_value=null",
    ]
    alignflow(*base, "tracking.keep_checkpoints=true", "tracking.log_checkpoints=all")
    alignflow(*base, "sft.max_steps=4", "tracking.log_checkpoints=all")
    outputs = home / "outputs" / "minimal"
    tracking_uri = f"sqlite:///{home}/mlflow.db"
    client = MlflowClient(tracking_uri, registry_uri=tracking_uri)

    def describe(run_id):
        run = client.get_run(run_id)
        return RunFacts(run.info.status, run.data.tags["alignflow.stage"])

    first, second = sorted(
        (f for f in stage_folders(outputs.parent, describe) if f.stage == "sft"), key=lambda f: f.modified
    )
    assert sorted(p.name for p in first.path.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6"]
    assert list(second.path.glob("checkpoint-*")) == []  # pruned when the stage finished: model/ stays
    assert (second.path / "model" / "config.json").is_file()
    # a stage in progress: a RUNNING run and its folder
    experiment = client.get_experiment_by_name("alignflow").experiment_id
    live_run = client.create_run(experiment, run_name="sft", tags={"alignflow.stage": "sft"}).info.run_id
    live = outputs / "in-progress" / "sft"
    (live / "checkpoint-2").mkdir(parents=True)
    (live / RUN_ID_FILE).write_text(live_run)

    # another state folder's finished stage run on the same tracking store, with checkpoints in MLflow
    other_run = client.create_run(experiment, run_name="sft", tags={"alignflow.stage": "sft"}).info.run_id
    (home.parent / "checkpoint-1").mkdir()
    (home.parent / "checkpoint-1" / "optimizer.pt").write_bytes(b"state")
    client.log_artifacts(other_run, str(home.parent / "checkpoint-1"), "checkpoints/checkpoint-1")
    client.set_terminated(other_run)
    other_folder = home.parent / "other-home" / "outputs" / "minimal" / "sft-other"
    other_folder.mkdir(parents=True)
    (other_folder / RUN_ID_FILE).write_text(other_run)

    before = tree(home / "outputs")
    dry = alignflow("gc", "--older-than", "0s", "--keep-last", "1", "--mlflow-checkpoints", "--dry-run")
    assert other_run not in dry
    assert tree(home / "outputs") == before
    assert f"would remove {first.path} (" in dry and "superseded" in dry
    assert f"would remove MLflow checkpoints/ of stage run {first.run_id} (sft)" in dry
    assert "kept 3 stage folders (1 live)" in dry  # the newer sft and evaluate folders, the live one

    alignflow("gc", "--older-than", "0s", "--keep-last", "1", "--mlflow-checkpoints")
    assert not first.path.exists() and (second.path / "model").is_dir()
    assert (live / "checkpoint-2").is_dir()  # a live run keeps everything
    for run_id in (first.run_id, second.run_id):
        assert [a.path for a in client.list_artifacts(run_id)] == ["model"]
    assert [a.path for a in client.list_artifacts(other_run)] == ["checkpoints"]  # not this folder's run
    # the registry version lives in MLflow's artifact store: it still loads
    versions = client.search_model_versions("name = 'gc-model'")
    assert versions
    for version in versions:
        source = client.get_model_version_download_uri("gc-model", version.version)
        model_dir = download_artifacts(artifact_uri=source, tracking_uri=tracking_uri)
        assert AutoModelForCausalLM.from_pretrained(model_dir).num_parameters() > 0
    # the kept configuration reruns from its cached SFT
    assert re.search(r"train-sft.*Finished in state Cached", alignflow(*base, "sft.max_steps=4"))
