"""Promotion gate, standalone evaluation of MLflow model URIs, and comparison of >= 3 runs."""

from __future__ import annotations

import copy

import matplotlib.image
import pytest
from helpers import mlflow_client

from infra.core.config import EvaluationRequest, load_config

pytestmark = pytest.mark.flow

EXPERIMENT = "promotion-test"
REGISTERED = "promotion-test-model"
COMMON = [
    "stages=[sft, dpo]",
    f"tracking.experiment_name={EXPERIMENT}",
    f"promotion.registered_model={REGISTERED}",
    "promotion.metric=greedy_accuracy",
    "promotion.confidence=null",  # 20 prompts: the strong run's gain is real but not significant
    "promotion.min_value=null",  # the weak first champion scores 0 (the floor has its own unit test)
]


def run(*overrides):
    from flows.pipeline import experiment

    state = experiment(load_config("configs/minimal.yaml", [*COMMON, *overrides]), return_state=True)
    assert state.is_completed(), state.message
    return state.state_details.flow_run_id, state.result()


def parent_run(flow_run_id, experiment=EXPERIMENT):
    client = mlflow_client()
    (parent,) = client.search_runs(
        [client.get_experiment_by_name(experiment).experiment_id],
        f"tags.`prefect.flow_run_id` = '{flow_run_id}' and tags.`alignflow.kind` = 'experiment'",
    )
    return parent


@pytest.fixture(scope="module")
def three_runs(prefect_api_url):
    """A weak first champion, a better run (longer SFT) that takes over, then a weak one that does not."""
    weak = run("name=weak")
    strong = run("name=strong", "sft.max_steps=150", "sft.learning_rate=0.003")
    weak_again = run("name=weak-again")
    return weak, strong, weak_again


def test_promotion_gate_promotes_better_runs_only(three_runs):
    (weak_id, weak), (strong_id, strong), (again_id, again) = three_runs
    client = mlflow_client()
    assert "champion" not in weak.rows
    assert parent_run(weak_id).data.tags["alignflow.promotion"].startswith("promoted: promotion-test-model version 1")

    assert strong.rows["dpo"]["greedy_accuracy"] > strong.rows["champion"]["greedy_accuracy"]
    assert strong.rows["champion"]["greedy_accuracy"] == weak.rows["dpo"]["greedy_accuracy"]  # same prompts, same seeds
    assert parent_run(strong_id).data.tags["alignflow.promotion"].startswith("promoted: promotion-test-model version 2")

    assert again.rows["dpo"]["greedy_accuracy"] < again.rows["champion"]["greedy_accuracy"]
    assert parent_run(again_id).data.tags["alignflow.promotion"].startswith("rejected: greedy_accuracy")

    champion = client.get_model_version_by_alias(REGISTERED, "champion")
    assert str(champion.version) == "2"
    assert champion.run_id == parent_child(strong_id, "dpo")
    assert float(champion.tags["eval.greedy_accuracy"]) == pytest.approx(
        strong.rows["dpo"]["greedy_accuracy"], abs=1e-5
    )
    assert len(client.search_model_versions(f"name = '{REGISTERED}'")) == 2


def test_a_champion_with_another_tokenizer_is_neither_scored_nor_replaced(three_runs, tiny, tmp_path):
    """A run whose base model has another tokenizer (here: another chat template) cannot score the
    champion on its token ids: the champion is left out of the evaluation and stays champion."""
    model, tokenizer = tiny
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    model.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    client = mlflow_client()
    before = client.get_model_version_by_alias(REGISTERED, "champion").version

    flow_run_id, report = run(
        "name=other-tokenizer",
        f"model.source={tmp_path / 'base'}",
        "stages=[sft]",
        "tracking.experiment_name=tokenizers",
    )
    assert "champion" not in report.rows
    assert parent_run(flow_run_id, "tokenizers").data.tags["alignflow.promotion"] == (
        f"rejected: champion version {before} is not comparable: the champion uses another tokenizer: "
        "scoring it on this run's token ids would be meaningless"
    )
    assert client.get_model_version_by_alias(REGISTERED, "champion").version == before


def parent_child(flow_run_id, stage, experiment=EXPERIMENT):
    client = mlflow_client()
    parent = parent_run(flow_run_id, experiment)
    (child,) = client.search_runs(
        [parent.info.experiment_id],
        f"tags.mlflow.parentRunId = '{parent.info.run_id}' and tags.`alignflow.stage` = '{stage}'",
    )
    return child.info.run_id


def test_evaluation_flow_scores_registry_and_run_uris(three_runs):
    from flows.evaluation import evaluation

    (_, _), (strong_id, strong), (_, again) = three_runs
    minimal = load_config("configs/minimal.yaml")
    request = EvaluationRequest(
        name="eval-uris",
        models={
            "champion": f"models:/{REGISTERED}@champion",
            "strong_sft": f"runs:/{parent_child(strong_id, 'sft')}/model",
        },
        data=minimal.data,
        evaluation=minimal.evaluation,
        tracking={"experiment_name": "evaluation-test"},
    )
    report = evaluation(request)
    assert report.num_prompts == 20
    # Same prompts and seeds as the pipeline's evaluation: the champion (strong's DPO model) scores identically.
    assert report.rows["champion"]["greedy_accuracy"] == again.rows["champion"]["greedy_accuracy"]
    assert report.rows["champion"]["sampled_accuracy"] == strong.rows["dpo"]["sampled_accuracy"]
    assert report.rows["strong_sft"]["sampled_accuracy"] == strong.rows["sft"]["sampled_accuracy"]


def test_compare_three_runs_writes_table_and_plots(three_runs):
    from flows.compare import compare

    (weak_id, _), (strong_id, strong), _ = three_runs
    report = compare(experiment=EXPERIMENT, baseline="weak", metrics=["greedy_accuracy", "sampled_accuracy"])
    assert report.baseline_run_id == parent_run(weak_id).info.run_id
    assert len(report.run_ids) == 3
    lines = report.table.splitlines()
    assert len(lines) == 2 + 3
    assert lines[0].startswith("| run | baseline | name | sft.max_steps | greedy_accuracy | Δ greedy_accuracy |")
    strong_row = next(line for line in lines if parent_run(strong_id).info.run_id[:8] in line)
    assert f"{strong.rows['dpo']['greedy_accuracy']:.3f}" in strong_row

    from pathlib import Path

    folder = Path(report.folder)
    curves = matplotlib.image.imread(folder / "training_curves.png")
    bars = matplotlib.image.imread(folder / "eval_metrics.png")
    assert curves.shape[1] > 2 * curves.shape[0]  # one panel per curve metric
    # the runs differ in SFT's settings: SFT's curves, those its stage names
    assert (report.stage, report.curves) == ("sft", ["loss", "grad_norm"])
    assert bars.shape[0] > 300
    client = mlflow_client()
    logged = {a.path for a in client.list_artifacts(report.mlflow_run_id)}
    assert {"table.md", "table.json", "training_curves.png", "eval_metrics.png"} <= logged


def test_a_run_that_reused_a_stage_shows_the_curves_of_the_run_that_trained_it(three_runs):
    from tasks.compare import summarize

    (weak_id, _), _, (again_id, _) = three_runs
    weak, again = (summarize(parent_run(flow_run), ["loss"], "sft") for flow_run in (weak_id, again_id))
    assert again.curves["loss"]  # weak-again's SFT was a cache hit: weak's SFT run has its curve
    assert again.curves == weak.curves


def test_compare_selects_runs_by_name_filter_and_recency(three_runs):
    from flows.compare import compare

    (weak_id, _), (strong_id, _), (again_id, _) = three_runs
    weak, strong, again = (parent_run(run).info.run_id for run in (weak_id, strong_id, again_id))
    assert compare(experiment=EXPERIMENT, runs=["weak", strong]).run_ids == [weak, strong]
    assert compare(experiment=EXPERIMENT, filter="params.`sft.max_steps` = '6'").run_ids == [weak, again]
    report = compare(experiment=EXPERIMENT, filter="params.`sft.max_steps` = '6'", last=1)
    assert report.run_ids == [again] and report.baseline_run_id == again
    # the default metrics are those the runs measured: 2 samples per prompt give no pass@4
    header = report.table.splitlines()[0]
    assert "sampled_accuracy" in header and "pass_at_4" not in header


def test_one_evaluate_compares_a_base_folder_and_its_hub_copy_with_its_sft_and_grpo_models_from_mlflow(
    prefect_api_url, tiny, tmp_path
):
    """A user's own base model, as a folder and as a hub id (its files in the Hugging Face cache, as a
    download leaves them), trained by SFT and GRPO; one `alignflow evaluate` scores the four: every
    tokenizer compares equal although the stages saved theirs again."""
    import os
    import shutil
    import subprocess
    import sys

    model, tokenizer = tiny
    base = tmp_path / "own-base"
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    snapshot = tmp_path / "hub" / "models--acme--own-base"
    (snapshot / "refs").mkdir(parents=True)
    (snapshot / "refs" / "main").write_text("0" * 40)
    shutil.copytree(base, snapshot / "snapshots" / ("0" * 40))

    flow_run_id, _ = run(
        "name=own-base",
        f"model.source={base}",
        "stages=[sft, grpo]",
        "sft.seed=41",  # the built-in model's weights: a seed of its own, or SFT is the weak run's, cached
        "tracking.experiment_name=own-base",
        "promotion.registered_model=null",
    )
    runs = {stage: parent_child(flow_run_id, stage, "own-base") for stage in ("sft", "grpo")}
    sources = {"base": str(base), "hub": "acme/own-base", **{s: f"runs:/{run_id}/model" for s, run_id in runs.items()}}
    models = "models={" + ", ".join(f"{label}: '{source}'" for label, source in sources.items()) + "}"
    env = {
        **os.environ,
        "PREFECT_API_URL": prefect_api_url,
        "HF_HUB_CACHE": str(tmp_path / "hub"),
        "HF_HUB_OFFLINE": "1",
    }
    result = subprocess.run(
        [sys.executable, "-m", "infra.ops.cli", "evaluate", "configs/evaluate.yaml", models, "name=own-base-eval",
         "data.builtin={max_operand: 9, noise: 0.3, num_eval_problems: 20, seed: 0}", "evaluation.num_samples=2",
         "tracking.experiment_name=own-base-eval"],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    (evaluation,) = mlflow_client().search_runs(
        [mlflow_client().get_experiment_by_name("own-base-eval").experiment_id], "tags.`alignflow.kind` = 'evaluation'"
    )
    scored = {key.split("/")[1] for key in evaluation.data.metrics if key.startswith("eval/")}
    assert scored == {"base", "hub", "sft", "grpo"}
    for name in ("greedy_accuracy", "sampled_accuracy"):  # the hub copy is the base folder's model: the same scores
        assert evaluation.data.metrics[f"eval/hub/{name}"] == evaluation.data.metrics[f"eval/base/{name}"]
