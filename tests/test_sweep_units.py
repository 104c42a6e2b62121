"""Sweeps without a server: the sweep file, trial validation, the search plan, the seed field, the
seed-aggregated table, and the lock that makes concurrent cached tasks compute once."""

from __future__ import annotations

import math
import threading
import time

import pytest
import yaml

from infra.core.config import ExperimentConfig, load_config, seeded_fields
from infra.core.locks import TaskLockManager
from infra.core.sweep import STRATEGIES, SweepConfig, objective_errors, read_sweep_tree
from infra.ops.cli import main
from tasks.reporting import mean_sd_cell, seed_aggregates
from tasks.search import SAMPLERS, plan, sweep_errors
from tasks.sweep import TrialResult, best_trial, separation

pytestmark = pytest.mark.unit


def write_sweep(tmp_path, **fields) -> str:
    tree = {"name": "t", "base": "configs/minimal.yaml", "space": {"dpo.beta": [0.1, 0.5]}} | fields
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(tree))
    return str(path)


def sweep_cli(*argv: str) -> int:
    """``alignflow sweep ARGV``'s exit code (load errors exit through SystemExit)."""
    try:
        return main(["sweep", *argv])
    except SystemExit as exit:
        return exit.code


def load_sweep(path: str, overrides=()) -> SweepConfig:
    return load_config(path, list(overrides), SweepConfig, reader=read_sweep_tree)


def test_seed_aggregates_two_seeds_against_hand_computed_mean_and_sd():
    trials = [
        ({"dpo.beta": 0.1, "seed": 0}, {"acc": 0.50, "acc_ci_low": 0.4, "tokens": 3.0}),
        ({"dpo.beta": 0.5, "seed": 0}, {"acc": 0.70, "tokens": 2.0}),
        ({"dpo.beta": 0.1, "seed": 1}, {"acc": 0.60, "acc_ci_low": 0.5, "tokens": 5.0}),
    ]
    rows = seed_aggregates(trials)
    assert [row["dpo.beta"] for row in rows] == [0.1, 0.5]
    first, second = rows
    assert first["seeds"] == 2 and second["seeds"] == 1
    # mean (0.5 + 0.6) / 2 = 0.55; sd = sqrt(((0.5 - 0.55)² + (0.6 - 0.55)²) / 1) = 0.0707107
    assert first["acc"] == pytest.approx((0.55, 0.0707107), abs=1e-6)
    assert first["tokens"] == pytest.approx((4.0, math.sqrt(2.0)))  # (3 + 5) / 2; sqrt((1 + 1) / 1)
    assert second["acc"][0] == 0.70 and math.isnan(second["acc"][1])
    assert "acc_ci_low" not in first and "seed" not in first
    assert mean_sd_cell(first["acc"]) == "0.550 ± 0.071" and mean_sd_cell(second["acc"]) == "0.700 ± —"


def test_seed_sets_every_seeded_field_and_a_conflicting_one_is_an_error():
    config = load_config("configs/minimal.yaml", ["seed=7"])
    stages = ["sft", "dpo", "grpo", "kto", "reward", "distill"]
    assert seeded_fields() == ["model.seed", *(f"{stage}.seed" for stage in stages), "evaluation.seed"]
    seeds = [config.model.seed, *(config.stage(stage).seed for stage in stages)]
    assert [*seeds, config.evaluation.seed] == [7] * 8
    assert config.data.builtin.seed == 0 and config.data.seed == 0  # the task and the mixture stay fixed
    assert ExperimentConfig.model_validate(config.model_dump()) == config  # a dumped config validates again
    assert load_config("configs/minimal.yaml", ["seed=7", "dpo.seed=7"]).dpo.seed == 7
    with pytest.raises(ValueError, match="seed: 7 sets dpo.seed, which is also set to 3"):
        load_config("configs/minimal.yaml", ["seed=7", "dpo.seed=3"])


def test_the_strategies_of_the_schema_are_the_registered_samplers():
    assert set(STRATEGIES) == set(SAMPLERS)


def test_a_grid_plans_every_combination_once_and_trials_get_their_values(tmp_path):
    path = write_sweep(tmp_path, space={"dpo.beta": [0.1, 0.5], "dpo.loss_type": ["sigmoid", "ipo"]})
    spec = load_sweep(path, ["base.stages=[sft, dpo]"])
    _, trials = plan(spec)
    assert sorted((t.params["dpo.beta"], t.params["dpo.loss_type"]) for t in trials) == [
        (0.1, "ipo"),
        (0.1, "sigmoid"),
        (0.5, "ipo"),
        (0.5, "sigmoid"),
    ]
    assert [t.number for t in trials] == [0, 1, 2, 3] and sweep_errors(spec, trials) == []
    config = spec.trial_config(trials[2].params, 2)
    assert (config.dpo.beta, config.dpo.loss_type) == (trials[2].params["dpo.beta"], trials[2].params["dpo.loss_type"])
    assert config.stages == ["sft", "dpo"] and config.run_name == "t-2"
    assert config.promotion.registered_model is None  # trials never promote


def test_random_and_tpe_plans_are_reproducible_and_stay_in_range(tmp_path):
    space = {
        "dpo.beta": {"low": 0.05, "high": 1.0, "log": True},
        "sft.max_steps": {"low": 2, "high": 4, "integer": True},
    }
    spec = load_sweep(write_sweep(tmp_path, strategy="random", num_trials=5, space=space))
    first, second = plan(spec)[1], plan(spec)[1]
    assert [t.params for t in first] == [t.params for t in second] and len(first) == 5
    assert all(0.05 <= t.params["dpo.beta"] <= 1.0 and t.params["sft.max_steps"] in (2, 3, 4) for t in first)
    search, planned = plan(load_sweep(write_sweep(tmp_path, strategy="tpe", num_trials=3, space=space)))
    assert planned == [] and search.adaptive  # asked as results come in
    assert 0.05 <= search.ask().params["dpo.beta"] <= 1.0


@pytest.mark.parametrize(
    ("fields", "overrides", "message"),
    [
        ({}, ["space.dpo.beta=[0.1, -1]"], "space.dpo.beta=-1: dpo.beta: Input should be greater than 0"),
        ({}, ["space.dpo.bta=[0.1]"], "space.dpo.bta=0.1: dpo.bta: Extra inputs are not permitted"),
        ({"space": {"seed": [0, 1]}}, ["base.sft.seed=4"], "space.seed=0: seed: 0 sets sft.seed"),
        ({"objective": {"metric": "acc"}}, [], "objective.metric: 'acc' is not a metric the evaluation produces"),
        (  # no evaluation.reward_model in the base: no reward model score
            {"objective": {"metric": "reward_model_score"}},
            [],
            "objective.metric: 'reward_model_score' is not a metric the evaluation produces",
        ),
    ],
)
def test_an_invalid_trial_value_is_reported_with_its_field_before_anything_runs(
    tmp_path, capsys, fields, overrides, message
):
    assert sweep_cli(write_sweep(tmp_path, **fields), *overrides) == 2
    assert message in capsys.readouterr().err


def test_the_reward_models_score_is_an_objective_when_the_base_evaluation_has_a_reward_model(tmp_path):
    path = write_sweep(tmp_path, objective={"metric": "reward_model_score"})
    rlhf = ["base.stages=[sft, reward, grpo]", "base.grpo.reward_funcs=[model:reward]"]
    assert objective_errors(load_sweep(path, [*rlhf, "base.evaluation.reward_model=reward"])) == []
    assert objective_errors(load_sweep(path, rlhf))[0].startswith("objective.metric: 'reward_model_score' is not")


def test_a_suite_tasks_metric_is_an_objective_when_the_base_evaluation_scores_that_task(tmp_path):
    path = write_sweep(tmp_path, objective={"metric": "addition/exact_match/none"})
    assert objective_errors(load_sweep(path, ["base.evaluation.suites=[{task: 'builtin:addition'}]"])) == []
    (problem,) = objective_errors(load_sweep(path, ["base.evaluation.suites=[]"]))
    assert problem.startswith("objective.metric: 'addition/exact_match/none' is not a metric the evaluation produces")
    assert problem.endswith("or a metric of a task of evaluation.suites (`<task>/<metric>/<filter>`)")


def test_a_combination_invalid_only_together_names_its_trial(tmp_path, capsys):
    """Each value is valid over the base (max_length 32, max_prompt_length 16); 20 with 24 is not."""
    path = write_sweep(tmp_path, space={"data.max_length": [20, 32], "data.max_prompt_length": [16, 24]})
    assert sweep_cli(path) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"alignflow: invalid sweep: {path}: trial ")
    assert line.endswith(
        "(data.max_length=20, data.max_prompt_length=24): data: max_prompt_length (24) must be less than "
        "max_length (20): no token would be left for the completion"
    )


def test_sweep_file_errors_name_the_file_and_the_field(tmp_path, capsys):
    path = write_sweep(tmp_path, strategy="random")
    assert sweep_cli(path) == 2
    assert f"invalid config: {path}: num_trials: strategy 'random' needs a number of trials" in capsys.readouterr().err
    assert sweep_cli(write_sweep(tmp_path, space={"dpo.beta": {"low": 0.1, "high": 0.5}})) == 2
    assert "space.dpo.beta: a grid needs a list of values, not a range" in capsys.readouterr().err


def test_plan_prints_the_trials_and_runs_nothing(tmp_path, capsys):
    assert sweep_cli("configs/seeds.yaml", "--plan") == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "3 trials, grid"
    assert sorted(line.split(": ", 1)[1] for line in out.splitlines()[:3]) == ["seed=0", "seed=1", "seed=2"]
    assert sweep_cli("configs/sweep.yaml", "--plan") == 0


def test_concurrent_holders_of_one_key_run_one_after_the_other(tmp_path):
    """The SERIALIZABLE cache lock: a second holder waits until the first releases, across threads
    (and processes: it is a kernel file lock)."""
    manager = TaskLockManager(lambda: tmp_path)
    events = []

    def hold(name: str) -> None:
        assert manager.acquire_lock("train-sft-abc", holder=name)
        events.append(f"{name} in")
        time.sleep(0.2)
        events.append(f"{name} out")
        manager.release_lock("train-sft-abc", holder=name)

    first = threading.Thread(target=hold, args=("a",))
    first.start()
    time.sleep(0.05)
    assert manager.is_locked("train-sft-abc") and not manager.acquire_lock("train-sft-abc", "b", acquire_timeout=0)
    hold("b")
    first.join()
    assert events == ["a in", "a out", "b in", "b out"]
    assert not manager.is_locked("train-sft-abc") and manager.wait_for_lock("train-sft-abc", 0)


def trial(number: int, value: float, low: float | None = None, high: float | None = None) -> TrialResult:
    metrics = {"sampled_accuracy": value}
    if low is not None:
        metrics |= {"sampled_accuracy_ci_low": low, "sampled_accuracy_ci_high": high}
    return TrialResult(number=number, params={}, status="completed", metrics=metrics)


def test_a_best_trial_that_ties_or_lies_in_its_own_interval_is_not_separated():
    def verdict(trials, direction="maximize"):
        best = best_trial(trials, "sampled_accuracy", direction)
        return best.number, separation(trials, best, "sampled_accuracy", direction)

    zeros = [trial(0, 0.0), trial(1, 0.0), trial(2, 0.0)]  # trials too short to learn the task
    assert verdict(zeros) == (0, "trial 0 ties with trial 1 (sampled_accuracy = 0.000)")
    close = [trial(0, 0.30, 0.22, 0.38), trial(1, 0.25, 0.18, 0.33)]
    assert verdict(close) == (0, "trial 1 (sampled_accuracy = 0.250) lies inside trial 0's 95% interval [0.220, 0.380]")
    apart = [trial(0, 0.60, 0.52, 0.68), trial(1, 0.25, 0.18, 0.33)]
    assert verdict(apart) == (0, None)
    assert verdict([trial(0, 0.30), trial(1, 0.25)]) == (0, None)  # no interval: a strict difference
    assert verdict([trial(0, 0.30, 0.22, 0.38), trial(1, 0.25)], "minimize") == (1, None)  # trial 1 has no interval
    assert verdict([trial(4, 0.5, 0.4, 0.6)]) == (4, None)  # alone


def test_a_trial_that_starts_again_fails_its_lost_attempt_and_the_attempts_stage_runs(monkeypatch):
    """What a trial does first (``flows.sweep.trial``): the attempt a dead Dask worker left RUNNING
    under the sweep's run, and its stage run, are FAILED and tagged; other trials' runs are left alone."""
    from tasks.mlflow_runs import client, experiment_id
    from tasks.sweep import LOST_ATTEMPT, fail_lost_attempts, trial_rows

    experiment = experiment_id("lost-attempts")
    sweep = client().create_run(experiment, run_name="grid").info.run_id
    nested = {"mlflow.parentRunId": sweep}
    lost = client().create_run(experiment, run_name="grid-3", tags=nested).info.run_id
    lost_stage = client().create_run(experiment, run_name="sft", tags={"mlflow.parentRunId": lost}).info.run_id
    other = client().create_run(experiment, run_name="grid-4", tags=nested).info.run_id
    assert fail_lost_attempts("lost-attempts", sweep, "grid-3") == 1
    for run_id, status in ((lost, "FAILED"), (lost_stage, "FAILED"), (other, "RUNNING"), (sweep, "RUNNING")):
        run = client().get_run(run_id)
        assert run.info.status == status, run_id
        assert (LOST_ATTEMPT in run.data.tags) == (status == "FAILED")
    assert fail_lost_attempts("lost-attempts", sweep, "grid-3") == 0  # the next attempt finds none
    retried = TrialResult(number=3, params={"dpo.beta": 0.1}, status="completed", lost_attempts=1)
    assert trial_rows([retried], "sampled_accuracy")[0]["lost attempts"] == 1
