"""Acceptance of issue 11: ``kill -9`` of a real ``alignflow run`` during each stage, once a
checkpoint of the stage exists, then the identical rerun. The rerun resumes the killed stage from
its latest complete checkpoint, in the same MLflow run, and reuses the stages that had finished;
the final weights equal an uninterrupted run's. Three random kills per stage:
``benchmarks/kill_resume.py``."""

from __future__ import annotations

import pytest
from killing import (
    STAGES,
    Kill,
    compare_metrics,
    duplicate_steps,
    latest_flow_run_id,
    max_weight_difference,
    metric_histories,
    mlflow_client,
    run,
    run_and_kill,
    stage_run_id,
    stage_run_tags,
    stage_snapshot,
    write_config,
)
from test_pipeline import task_states


@pytest.fixture(scope="module")
def uninterrupted(prefect_api_url, tmp_path_factory):
    """One uninterrupted run of the kill-test config, shared by every kill test."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    config = write_config(folder)
    run(config, folder / "home", prefect_api_url)
    return config, folder / "home"


@pytest.mark.parametrize("stage", STAGES)
def test_a_stage_killed_after_a_checkpoint_resumes_to_the_uninterrupted_result(
    stage, uninterrupted, prefect_api_url, tmp_path
):
    config, reference = uninterrupted
    home = tmp_path / "home"
    kill = run_and_kill(config, home, prefect_api_url, Kill(stage, after_checkpoints=1))
    earlier = STAGES[: STAGES.index(stage)]
    before = {name: stage_snapshot(home, name) for name in earlier}
    killed_run = stage_run_id(home, stage)

    run(config, home, prefect_api_url)

    for name in STAGES:
        assert max_weight_difference(home, reference, name) <= 1e-6, name
    # the same MLflow run, finished, tagged as resumed from the latest complete checkpoint by this flow run
    assert stage_run_id(home, stage) == killed_run
    tags = stage_run_tags(home, stage)
    assert tags["alignflow.resumed"] == "true"
    assert int(tags["alignflow.resumed_from_step"]) == max(kill.checkpoints_at_kill)
    assert tags["alignflow.resumed_by_flow_run_id"] == latest_flow_run_id(home)
    assert mlflow_client(home).get_run(killed_run).info.status == "FINISHED"
    # every metric once per step, at the steps and with the values of the uninterrupted run
    histories = metric_histories(home, stage)
    assert duplicate_steps(histories) == {}
    assert compare_metrics(histories, metric_histories(reference, stage)) == []
    # stages that had finished were reused: no new checkpoint, model or run; SFT is a Prefect cache hit
    for name in earlier:
        assert stage_snapshot(home, name) == before[name], name
        assert "alignflow.resumed" not in stage_run_tags(home, name), name
    if earlier:
        assert task_states(latest_flow_run_id(home))["train-sft"] == "Cached"
