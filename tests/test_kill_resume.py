"""Acceptance of issue 11: ``kill -9`` of a real ``alignflow run`` during each stage, once a
checkpoint of the stage exists, then the identical rerun. The rerun resumes the killed stage from
its latest complete checkpoint, in the same MLflow run, and reuses the stages that had finished;
the final weights equal an uninterrupted run's. One chain of kills covers the three stages (each
rerun is killed in the next stage: ``killed_in_every_stage``). Three random kills per stage:
``benchmarks/kill_resume.py``."""

from __future__ import annotations

import json

import pytest
from helpers import MINIMAL, run_flow, task_states
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
from prefect.client.orchestration import get_client
from safetensors.torch import load_file

pytestmark = pytest.mark.flow


@pytest.fixture(scope="module")
def uninterrupted(prefect_api_url, tmp_path_factory):
    """One uninterrupted run of the kill-test config, shared by every kill test."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    config = write_config(folder)
    run(config, folder / "home", prefect_api_url)
    return config, folder / "home"


@pytest.fixture(scope="module")
def killed_in_every_stage(uninterrupted, prefect_api_url, tmp_path_factory):
    """One state folder through one chain of kills, shared by the kill tests: the run is killed in
    SFT once it has a checkpoint; its rerun resumes SFT and is killed in DPO; the next resumes DPO
    and is killed in GRPO; the last resumes GRPO and finishes. Per stage: the kill, the stage's
    MLflow run when it was killed, the flow run that resumed it, and what the stages before it
    were before that rerun (they had finished) and after it."""
    config, _ = uninterrupted
    home = tmp_path_factory.mktemp("killed") / "home"
    kills = {STAGES[0]: run_and_kill(config, home, prefect_api_url, Kill(STAGES[0], after_step=3))}
    killed_flow_runs = [latest_flow_run_id(home)]
    chain = {}
    for stage, next_stage in zip(STAGES, [*STAGES[1:], None]):
        killed_run = stage_run_id(home, stage)
        earlier = STAGES[: STAGES.index(stage)]
        before = {name: stage_snapshot(home, name) for name in earlier}
        if next_stage is None:
            run(config, home, prefect_api_url)
        else:
            kills[next_stage] = run_and_kill(config, home, prefect_api_url, Kill(next_stage, after_step=3))
            killed_flow_runs.append(latest_flow_run_id(home))
        resumed_by = latest_flow_run_id(home)
        after = {name: stage_snapshot(home, name) for name in earlier}
        chain[stage] = dict(kill=kills[stage], killed_run=killed_run, resumed_by=resumed_by, before=before, after=after)
    return home, chain, killed_flow_runs


@pytest.mark.parametrize("stage", STAGES)
def test_a_stage_killed_after_a_checkpoint_resumes_to_the_uninterrupted_result(
    stage, killed_in_every_stage, uninterrupted
):
    _, reference = uninterrupted
    home, chain, _ = killed_in_every_stage
    kill, killed_run, resumed_by = chain[stage]["kill"], chain[stage]["killed_run"], chain[stage]["resumed_by"]
    assert max_weight_difference(home, reference, stage) <= 1e-6
    # the same MLflow run, finished, tagged as resumed from the latest complete checkpoint by the rerun
    assert stage_run_id(home, stage) == killed_run
    tags = stage_run_tags(home, stage)
    assert tags["alignflow.resumed"] == "true"
    assert int(tags["alignflow.resumed_from_step"]) == max(kill.checkpoints_at_kill)
    assert tags["alignflow.resumed_by_flow_run_id"] == resumed_by
    assert mlflow_client(home).get_run(killed_run).info.status == "FINISHED"
    # every metric once per step, at the steps and with the values of the uninterrupted run
    histories = metric_histories(home, stage)
    assert duplicate_steps(histories) == {}
    assert compare_metrics(histories, metric_histories(reference, stage)) == []
    # stages that had finished were reused by the rerun: no new checkpoint, model or run; SFT is a Prefect cache hit
    earlier = STAGES[: STAGES.index(stage)]
    assert chain[stage]["after"] == chain[stage]["before"]
    for name in earlier:  # resumed by the rerun after their own kill, not by this one
        assert stage_run_tags(home, name)["alignflow.resumed_by_flow_run_id"] == chain[name]["resumed_by"] != resumed_by
    if earlier:
        assert task_states(resumed_by)["train-sft"] == "Cached"


def test_each_killed_run_is_marked_failed_and_crashed_by_the_next_run_and_none_is_left_running(
    killed_in_every_stage, uninterrupted
):
    """The rerun's start marked the killed attempt's runs (`alignflow runs cleanup`): each killed
    flow run's MLflow parent run FAILED with the reason, its Prefect flow run CRASHED; the final
    weights of every stage equal the uninterrupted run's."""
    _, reference = uninterrupted
    home, _, killed_flow_runs = killed_in_every_stage
    for name in STAGES:
        assert max_weight_difference(home, reference, name) <= 1e-6, name
    client = mlflow_client(home)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [r.info.run_name for r in runs if r.info.status == "RUNNING"] == []
    killed_parents = [r for r in runs if r.info.status == "FAILED" and "mlflow.parentRunId" not in r.data.tags]
    assert sorted(r.data.tags["prefect.flow_run_id"] for r in killed_parents) == sorted(killed_flow_runs)
    for parent in killed_parents:
        assert parent.data.tags["alignflow.failure_reason"].startswith("process gone")
    with get_client(sync_client=True) as prefect:
        assert [prefect.read_flow_run(f).state.type.value for f in killed_flow_runs] == ["CRASHED"] * len(STAGES)


FLAKY_REWARD = '''
import os
from pathlib import Path

CALLS = []


def flaky(prompts, completions, **columns):
    """Fails once, at its third call (GRPO's third generation batch), while FLAKY_REWARD_ONCE names a
    file that does not exist yet; 0 for every completion otherwise."""
    CALLS.append(1)
    flag = Path(os.environ["FLAKY_REWARD_ONCE"])
    if len(CALLS) == 3 and not flag.exists():
        flag.touch()
        raise RuntimeError("reward server unavailable")
    return [0.0 for _ in completions]
'''


def test_a_prefect_retry_resumes_the_failed_stage_from_its_checkpoint(prefect_api_url, tmp_path, monkeypatch):
    """The train task's retry (``retries=1``) after a failure at step 5 resumes from checkpoint-4, in the
    same MLflow run, and ends with the weights of a run that never failed."""
    from infra.core.config import load_config
    from infra.core.settings import get_settings
    from tasks.mlflow_runs import client

    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "alignflow_flaky_reward.py").write_text(FLAKY_REWARD)
    monkeypatch.setenv("FLAKY_REWARD_ONCE", str(tmp_path / "failed-once"))
    grpo = [
        "stages=[grpo]",
        "plugins=[alignflow_flaky_reward]",
        "grpo.reward_funcs=[alignflow_flaky_reward:flaky]",
        "grpo.max_steps=8",
        "grpo.save_steps=2",
        "grpo.logging_steps=2",
        "grpo.entropy_coef=0.1",
        "evaluation.num_prompts=4",
    ]
    flow_run_id, _ = run_flow(load_config(MINIMAL, [*grpo, "name=retried"]))
    assert (tmp_path / "failed-once").exists()  # it did fail once
    assert task_states(flow_run_id)["train-grpo"] == "Completed"
    (folder,) = (get_settings().outputs / "retried").glob("grpo-*")
    tags = client().get_run((folder / "mlflow_run_id").read_text()).data.tags
    assert tags["alignflow.resumed_from_step"] == "4" and tags["alignflow.resumed_by_flow_run_id"] == str(flow_run_id)
    assert tags["prefect.flow_run_id"] == str(flow_run_id)  # the retry continues its own flow run's stage run
    steps = [m.step for m in client().get_metric_history((folder / "mlflow_run_id").read_text(), "loss")]
    assert steps == [2, 4, 6, 8]

    run_flow(load_config(MINIMAL, [*grpo, "name=never-failed"]))  # the flag exists now: no failure
    (reference,) = (get_settings().outputs / "never-failed").glob("grpo-*")
    assert reference.name == folder.name  # the same content key: only the config name differs
    first, second = (load_file(f / "model" / "model.safetensors") for f in (folder, reference))
    assert max((first[k] - second[k]).abs().max().item() for k in first) <= 1e-6


def test_a_stage_stopped_between_saving_its_model_and_recording_it_saves_it_again(prefect_api_url):
    """``model/`` without ``model.json`` is not trusted (here it was also changed since): the rerun
    saves the model again from the final checkpoint, in the same run, without training a step, and
    sends what the checkpoint's log history holds and the run lacks (a kill after the checkpoint,
    before the metric sender delivered its step)."""
    from infra.core.config import load_config
    from infra.core.settings import get_settings
    from tasks.mlflow_runs import client
    from trainers.runtime.checkpoints import file_records

    # the checkpoints of a finished stage are kept here (by default they are pruned once it finished)
    overrides = ["stages=[dpo]", "name=unrecorded", "evaluation.num_prompts=4", "tracking.keep_checkpoints=true"]
    config = load_config(MINIMAL, overrides)
    run_flow(config)
    (folder,) = (get_settings().outputs / "unrecorded").glob("dpo-*")
    recorded = json.loads((folder / "model.json").read_text())
    (folder / "model.json").unlink()
    (folder / "model" / "config.json").write_text("{}")
    run_id = (folder / "mlflow_run_id").read_text()
    steps = [m.step for m in client().get_metric_history(run_id, "loss")]
    final = folder / "checkpoint-6"
    state, marker = (
        json.loads((final / "trainer_state.json").read_text()),
        json.loads((final / "checkpoint-complete.json").read_text()),
    )
    state["log_history"].append({"undelivered": 0.5, "step": 6})  # logged, never sent: the process was killed
    (final / "trainer_state.json").write_text(json.dumps(state))
    marker["files"] = file_records(final)  # still complete
    (final / "checkpoint-complete.json").write_text(json.dumps(marker))

    run_flow(config)
    assert json.loads((folder / "model.json").read_text()) == recorded
    assert client().get_run(run_id).data.tags["alignflow.resumed_from_step"] == "6"  # max_steps: nothing to train
    assert [m.step for m in client().get_metric_history(run_id, "loss")] == steps
    assert [(m.step, m.value) for m in client().get_metric_history(run_id, "undelivered")] == [(6, 0.5)]
