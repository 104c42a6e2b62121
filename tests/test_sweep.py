"""Sweeps end to end on the session's Prefect server: a 2×2 grid on a 2-worker LocalCluster, and a
sweep against an external Dask scheduler and two workers started here, one of whose trials fails."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import pytest
from helpers import ALIGNFLOW, PROJECT, SMOKE, dask_cluster, mlflow_client, state_folder_environment
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

from infra.core.config import load_config
from infra.core.launching import group_alive
from infra.core.ports import bind_error
from infra.core.settings import get_settings
from infra.core.stage_io import StageFolder
from infra.core.sweep import SweepConfig, read_sweep_tree
from infra.ops.cli import main
from tasks.sweep import TrialResult

# The example sweep cut to seconds: the minimal task, SFT and DPO only, few prompts, one sample each. An SFT seed
# of its own keeps this module's first SFT a cache miss whatever ran before.
TINY = [
    "base.stages=[sft, dpo]",
    "base.data.builtin={max_operand: 9, noise: 0.3, num_eval_problems: 20, seed: 0}",
    "base.sft.max_steps=2",
    "base.sft.save_steps=0",
    "base.sft.seed=31",
    "base.dpo.max_steps=2",
    "base.dpo.save_steps=0",
    "base.evaluation={num_prompts: 8, num_samples: 1, pass_k: [1], bootstrap_resamples: 10}",
    "objective.metric=greedy_accuracy",
]


def sweep_spec(path: str, *overrides: str) -> SweepConfig:
    return load_config(path, [*TINY, *overrides], SweepConfig, reader=read_sweep_tree)


def run_sweep(spec: SweepConfig):
    from flows.sweep import sweep

    state = sweep(spec, return_state=True)
    assert state.is_completed(), state.message
    return state.state_details.flow_run_id, state.result()


def task_states(flow_run_ids) -> list[tuple[str, str]]:
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=list(flow_run_ids))))
    return sorted((run.name.split("-logps")[0], run.state.name) for run in runs)


@pytest.fixture(scope="module")
def grid_temp(tmp_path_factory) -> Path:
    """The temp folder of the grid's sweep (this process's and its cluster's), to find what is left there."""
    return tmp_path_factory.mktemp("grid-temp")


@pytest.fixture(scope="module")
def grid(prefect_api_url, grid_temp):
    overrides = [
        "base.tracking.experiment_name=sweep-grid",
        "promote=true",
        "base.promotion.registered_model=sweep-grid",
        "base.promotion.min_value=null",  # two-step trials score 0: no floor
    ]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TMPDIR", str(grid_temp))
        patch.setattr(tempfile, "tempdir", str(grid_temp))  # gettempdir() reads TMPDIR once, then this
        return run_sweep(sweep_spec("configs/sweep.yaml", *overrides))


@pytest.mark.flow
def test_a_2x2_grid_gives_4_trial_runs_nested_under_one_sweep_run(grid):
    _, report = grid
    client = mlflow_client()
    sweep_run = client.get_run(report.sweep_run_id)
    assert sweep_run.data.tags["alignflow.kind"] == "sweep" and sweep_run.info.status == "FINISHED"
    children = client.search_runs([sweep_run.info.experiment_id], f"tags.mlflow.parentRunId = '{report.sweep_run_id}'")
    trials = [run for run in children if run.data.tags.get("alignflow.kind") == "experiment"]
    assert len(trials) == 4
    trial_ids = {run.info.run_id for run in trials}
    assert [run.info.run_name for run in children if run.info.run_id not in trial_ids] == ["evaluate"]  # the gate's
    assert all(run.info.status == "FINISHED" for run in trials)
    values = sorted((run.data.params["dpo.beta"], run.data.params["dpo.loss_type"]) for run in trials)
    assert values == [("0.1", "ipo"), ("0.1", "sigmoid"), ("0.5", "ipo"), ("0.5", "sigmoid")]
    assert sorted(run.data.tags["alignflow.trial"] for run in trials) == ["0", "1", "2", "3"]
    assert sorted(t.mlflow_run_id for t in report.trials) == sorted(run.info.run_id for run in trials)
    assert [t.status for t in report.trials] == ["completed"] * 4
    assert sweep_run.data.tags["alignflow.sweep.failed"] == ""

    best = max(report.trials, key=lambda t: (t.metrics["greedy_accuracy"], -t.number))
    assert report.best.number == best.number
    assert sweep_run.data.tags["alignflow.best_trial"] == str(best.number)
    assert sweep_run.data.metrics["best/greedy_accuracy"] == best.metrics["greedy_accuracy"]
    history = client.get_metric_history(report.sweep_run_id, "trial/greedy_accuracy")
    assert sorted(m.step for m in history) == [0, 1, 2, 3]


@pytest.mark.flow
def test_gc_keeps_every_trials_stage_folder_its_trials_are_not_versions_of_one_another(grid, capsys):
    """The four trials share a config name: counted as versions, gc would remove three DPO folders."""
    _, report = grid
    dpo_runs = {mlflow_client().get_run(t.mlflow_run_id).data.tags["alignflow.dpo_run_id"] for t in report.trials}
    folders = [f.path for f in StageFolder.under(get_settings().outputs) if f.recorded_run_id() in dpo_runs]
    assert len(folders) == 4
    assert main(["gc", "--older-than", "0s", "--keep-last", "1", "--dry-run"]) == 0
    planned = capsys.readouterr().out
    assert not [path for path in folders if f"would remove {path} (" in planned]


@pytest.mark.flow
def test_the_local_clusters_scratch_space_is_in_the_state_folder_not_in_tmp(grid, grid_temp):
    assert (get_settings().root / "dask" / "dask-scratch-space" / "global.lock").is_file()
    assert not (grid_temp / "dask-scratch-space").exists()


@pytest.mark.flow
def test_sft_and_the_reference_pass_run_once_for_all_four_trials(grid):
    """The trials share the SFT config: one trial trains SFT and computes the reference log-probs,
    the three others find them cached, including the one that started at the same moment."""
    _, report = grid
    states = task_states(t.flow_run_id for t in report.trials)
    assert [s for name, s in states if name == "train-sft"] == ["Cached", "Cached", "Cached", "Completed"]
    assert [s for name, s in states if name == "cache-reference"] == ["Cached", "Cached", "Cached", "Completed"]
    assert [s for name, s in states if name == "train-dpo"] == ["Completed"] * 4
    sft_runs = {mlflow_client().get_run(t.mlflow_run_id).data.tags["alignflow.sft_run_id"] for t in report.trials}
    assert len(sft_runs) == 1  # every trial's SFT model is the one trial's SFT run


@pytest.mark.flow
def test_the_sweep_run_has_the_comparison_and_the_seed_table(grid):
    flow_run_id, report = grid
    client = mlflow_client()
    artifacts = {a.path for a in client.list_artifacts(report.sweep_run_id)}
    assert {"trials.md", "trials.json", "seed_table.md", "seed_table.json", "comparison"} <= artifacts
    compared = {a.path for a in client.list_artifacts(report.sweep_run_id, "comparison")}
    assert {"comparison/table.md", "comparison/training_curves.png", "comparison/eval_metrics.png"} <= compared
    assert sorted(report.comparison.run_ids) == sorted(t.mlflow_run_id for t in report.trials)
    # one row per trial in the seed table (no seed axis: one "seed" each), with the trial's own value
    rows = json.loads(Path(client.download_artifacts(report.sweep_run_id, "seed_table.json")).read_text())
    assert [row["seeds"] for row in rows] == [1, 1, 1, 1]
    by_trial = {(t.params["dpo.beta"], t.params["dpo.loss_type"]): t for t in report.trials}
    for row in rows:
        assert row["greedy_accuracy"][0] == by_trial[row["dpo.beta"], row["dpo.loss_type"]].metrics["greedy_accuracy"]
    with get_client(sync_client=True) as prefect:
        found = prefect.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    keys = {a.key for a in found}
    assert {"sweep", "comparison"} <= keys
    (comparison,) = [a for a in found if a.key == "comparison"]
    assert "4 runs" in comparison.data and "dpo.beta" in comparison.data


@pytest.mark.flow
def test_the_best_trial_passes_the_promotion_gate_when_asked(grid):
    """``promote: true``: the best trial's DPO model, re-scored under the sweep run, becomes the
    first champion of the registered model; the trials themselves registered nothing."""
    _, report = grid
    client = mlflow_client()
    version = client.get_model_version_by_alias("sweep-grid", "champion")
    best_dpo = client.get_run(report.best.mlflow_run_id).data.tags["alignflow.dpo_run_id"]
    assert version.run_id == best_dpo and str(version.version) == "1"
    assert client.get_run(report.sweep_run_id).data.tags["alignflow.promotion"].startswith("promoted: sweep-grid")
    assert all("alignflow.promotion" not in client.get_run(t.mlflow_run_id).data.tags for t in report.trials)


@pytest.mark.flow
def test_a_sweep_on_an_external_scheduler_where_one_trial_fails_alone(
    prefect_api_url, state_dir, tmp_path, monkeypatch, capsys
):
    """`alignflow sweep` with two trials, one at a time (max_concurrent 1 over 2 workers): one reads a
    preference file with a row missing 'chosen' and fails at run time, naming the row and field; the
    other finishes, the sweep run says which failed, and the command exits 1 naming it. Nothing of
    the cluster is left running afterwards."""
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    pairs = [
        {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)} for a in range(8) for b in range(5)
    ]
    good.write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    bad.write_text(json.dumps(pairs[0]) + "\n" + json.dumps({"prompt": "1+1=", "rejected": "3"}) + "\n")
    env = {**os.environ, "ALIGNFLOW_HOME": str(state_dir), "PREFECT_API_URL": prefect_api_url, "OMP_NUM_THREADS": "1"}
    monkeypatch.setenv("PREFECT_API_URL", prefect_api_url)  # the command's own check for a shared API
    with dask_cluster(env, [["--name", "w0"], ["--name", "w1"]]) as (address, processes):
        overrides = [f"address={address}", "max_concurrent=1", "base.tracking.experiment_name=sweep-external"]
        space = "space={data.preference.path: [" + f"{good}, {bad}" + "]}"
        assert main(["sweep", "configs/sweep.yaml", *TINY, *overrides, space]) == 1  # a trial failed
    assert [process.poll() is not None for process in processes] == [True] * 3  # nothing left running
    assert not any(group_alive(process.pid) for process in processes)  # nor the workers' own processes
    assert bind_error("127.0.0.1", int(address.rsplit(":", 1)[1])) is None  # the scheduler's port is free again
    (error_line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("alignflow: trial")]
    assert error_line.endswith(f"(failed): DataValidationError: {bad}: row 1: field 'chosen' is missing")
    client = mlflow_client()
    experiment = client.get_experiment_by_name("sweep-external")
    (sweep_run,) = client.search_runs([experiment.experiment_id], "tags.`alignflow.kind` = 'sweep'")
    trials = json.loads(Path(client.download_artifacts(sweep_run.info.run_id, "trials.json")).read_text())
    by_path = {t.params["data.preference.path"]: t for t in map(TrialResult.model_validate, trials)}
    assert by_path[str(good)].status == "completed"
    failed = by_path[str(bad)]
    assert failed.status == "failed" and f"{bad}: row 1: field 'chosen' is missing" in failed.error
    assert client.get_run(failed.mlflow_run_id).info.status == "FAILED"
    assert client.get_run(by_path[str(good)].mlflow_run_id).info.status == "FINISHED"
    assert sweep_run.info.status == "FINISHED" and sweep_run.data.tags["alignflow.sweep.failed"] == str(failed.number)
    assert sweep_run.data.tags["alignflow.best_trial"] == str(by_path[str(good)].number)

    with get_client(sync_client=True) as prefect:  # the concurrency limit of 1: the trials never overlapped
        runs = prefect.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[failed.flow_run_id])))
        runs += prefect.read_flow_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[by_path[str(good)].flow_run_id]))
        )
        first, second = sorted(runs, key=lambda run: run.start_time)
        assert first.end_time <= second.start_time
        assert prefect.read_global_concurrency_limits() == []  # the sweep's limit is removed


@pytest.mark.slow
def test_the_sweep_command_keeps_its_temporary_server_until_prefect_sent_its_last_logs(tmp_path):
    """``alignflow sweep`` as a command on the embedded default. Its temporary server stops after
    Prefect's exit hooks: the command once stopped it first, and the hooks then spent over a minute
    retrying the last logs ("Error logging to API") before the process ended."""
    env = state_folder_environment(tmp_path) | {"OMP_NUM_THREADS": "1"}
    one_trial = ["base.stages=[sft]", "space={sft.learning_rate: [0.001]}", "workers=1", "max_concurrent=1"]
    command = [*ALIGNFLOW, "sweep", "configs/sweep.yaml", *TINY, *one_trial]
    result = subprocess.run(command, cwd=PROJECT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        "| trial | status | lost attempts | sft.learning_rate |" in result.stdout + result.stderr
    )  # the sweep's summary
    assert "Error logging to API" not in result.stdout + result.stderr


@pytest.mark.flow
def test_a_deployment_not_on_the_server_fails_the_sweep_before_any_trial(prefect_api_url):
    spec = sweep_spec("configs/sweep.yaml", "deployment=alignflow-experiment/nowhere")
    from flows.sweep import sweep

    state = sweep(spec, return_state=True)
    assert (
        state.is_failed() and "deployment: 'alignflow-experiment/nowhere' is not on the Prefect server" in state.message
    )


@pytest.mark.flow
def test_trials_as_runs_of_a_served_deployment(served_smoke):
    """``deployment:``: each trial is started with run_deployment as a run of the experiment
    deployment `smoke`, here served by `alignflow serve` (the session's; a work pool's workers take
    the same runs), with the trial's whole config: its experiment, stages and values, not the deployment's."""
    spec = sweep_spec(
        "configs/sweep.yaml",
        f"deployment={SMOKE}",
        "base.tracking.experiment_name=sweep-deployment",
        "space={dpo.beta: [0.1, 0.5]}",
    )
    _, report = run_sweep(spec)
    assert [t.status for t in report.trials] == ["completed", "completed"]
    with get_client(sync_client=True) as prefect:
        runs = prefect.read_flow_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[t.flow_run_id for t in report.trials]))
        )
        smoke = prefect.read_deployment_by_name(SMOKE)
    assert [run.deployment_id for run in runs] == [smoke.id, smoke.id]
    client = mlflow_client()
    for trial in report.trials:
        run = client.get_run(trial.mlflow_run_id)
        assert run.data.tags["mlflow.parentRunId"] == report.sweep_run_id
        assert (
            run.data.params["dpo.beta"] == str(trial.params["dpo.beta"])
            and run.data.params["stages"] == "['sft', 'dpo']"
        )
