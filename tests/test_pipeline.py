"""The whole experiment flow on a minimal config, on one session-wide Prefect test server."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import time

import mlflow
import pytest
import torch
from helpers import MINIMAL, PROJECT, mlflow_client, run_flow, task_states
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

from infra.core.config import load_config
from infra.core.reachability import TrackingServerUnreachable
from infra.core.refcache import ReferenceCache
from infra.core.settings import get_settings
from infra.ops.cli import main
from trainers.catalog import STAGES

pytestmark = pytest.mark.flow

# SFT is cached across flow runs by content; a seed of its own keeps this module's first run a miss
# whatever other test modules ran before.
UNIQUE = ["sft.seed=11"]


@pytest.fixture(scope="module")
def first_run(prefect_api_url):
    return run_flow(load_config(MINIMAL, UNIQUE))


def parent_and_children(flow_run_id):
    client = mlflow_client()
    experiment = client.get_experiment_by_name("alignflow")
    (parent,) = client.search_runs(
        [experiment.experiment_id],
        f"tags.`prefect.flow_run_id` = '{flow_run_id}' and tags.`mlflow.runName` = 'minimal'",
    )
    children = client.search_runs([experiment.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    return client, parent, {run.info.run_name: run for run in children}


def test_flow_logs_parent_child_runs_metrics_checkpoints_and_a_loadable_model(first_run):
    flow_run_id, report = first_run
    client, parent, children = parent_and_children(flow_run_id)
    assert parent.info.status == "FINISHED"
    assert set(children) == {"sft", "dpo", "grpo", "evaluate"}
    assert all(run.info.status == "FINISHED" for run in children.values())
    for stage in ("sft", "dpo", "grpo"):  # what `alignflow compare` plots of each stage, logged
        assert set(STAGES[stage].curves) <= children[stage].data.metrics.keys(), stage
    assert parent.data.params["dpo.beta"] == "0.5"
    assert parent.data.params["model.source"] == "builtin:tiny-llama"
    assert parent.data.tags["alignflow.config_hash"] == load_config(MINIMAL, UNIQUE).content_hash()
    checkout = subprocess.run(["git", "rev-parse", "HEAD"], cwd=PROJECT, capture_output=True, text=True, check=True)
    assert parent.data.tags["mlflow.source.git.commit"] == checkout.stdout.strip()  # this checkout's commit

    dpo = children["dpo"].info.run_id
    assert len(client.get_metric_history(dpo, "loss")) >= 2
    accuracies = client.get_metric_history(dpo, "rewards/accuracies")
    # each logged value averages a window of 2 batches of 8 pairs: a multiple of 1/16
    assert len(accuracies) >= 2 and all(
        (m.value * 16) == pytest.approx(round(m.value * 16), abs=1e-4) for m in accuracies
    )
    assert [m.step for m in client.get_metric_history(children["sft"].info.run_id, "loss")] == [2, 4, 6]
    # tracking.log_checkpoints: final (the default) stores the final model, not every checkpoint
    assert [a.path for a in client.list_artifacts(dpo)] == ["model"]

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = mlflow.artifacts.download_artifacts(
        run_id=dpo, artifact_path="model", tracking_uri=get_settings().mlflow_tracking_uri
    )
    model, tokenizer = AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    trained = AutoModelForCausalLM.from_pretrained(children["grpo"].data.params["policy.init"])  # DPO's output folder
    assert all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), trained.state_dict().values(), strict=True)
    )
    prompt = torch.tensor([tokenizer("3+4=").input_ids])
    output = model.generate(prompt, max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert output.shape[1] > prompt.shape[1]

    evaluation = children["evaluate"].info.run_id
    metrics = client.get_run(evaluation).data.metrics
    assert set(report.rows) == {"base", "sft", "dpo", "grpo"}
    assert metrics["dpo/sampled_accuracy"] == pytest.approx(report.rows["dpo"]["sampled_accuracy"])
    assert report.num_prompts == 20 and report.num_pairs == 20


def reference_input(run):
    (dataset_input,) = run.inputs.dataset_inputs
    return dataset_input.dataset, {tag.key: tag.value for tag in dataset_input.tags}


def test_dpo_run_lists_the_reference_cache_entry_as_an_input_with_its_digest(first_run, capsys):
    client, parent, children = parent_and_children(first_run[0])
    dpo = client.get_run(children["dpo"].info.run_id)
    key = dpo.data.tags["alignflow.reference_cache_key"]
    entry = ReferenceCache(get_settings().reference_cache_root).read(key)
    dataset, tags = reference_input(dpo)
    assert (dataset.name, dataset.digest, json.loads(dataset.source)) == (
        "reference-logps",
        entry.digest,
        {"uri": entry.uri},
    )
    assert tags["mlflow.data.context"] == "training"
    assert entry.rows == {"preference": 80, "preference_eval": 20}
    assert entry.manifest["producer"]["mlflow_run_id"] == parent.info.run_id
    assert entry.manifest["producer"]["prefect_flow_run_id"] == str(first_run[0])

    metrics = parent.data.metrics  # the reference stage's own figures
    assert metrics["reference/pairs/computed"] == 1.0 and metrics["reference/pairs/rows"] == 100
    assert metrics["reference/pairs/rows_per_second"] == pytest.approx(
        100 / metrics["reference/pairs/seconds"], rel=1e-6
    )

    assert main(["cache", "verify"]) == 0
    assert f"{key}  ok" in capsys.readouterr().out

    with get_client(sync_client=True) as prefect:
        artifacts = prefect.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[first_run[0]])))
    assert [a.data for a in artifacts if a.type == "progress"] == [100.0]  # the reference pass's progress bar


def test_second_run_hits_the_caches_and_never_runs_the_reference(first_run, monkeypatch):
    import tasks.data
    import tasks.evaluate
    import trainers.scoring.reference_pass

    calls, preparations, scored = [], [], []
    score_models = tasks.evaluate.score_models
    monkeypatch.setattr(trainers.scoring.reference_pass, "reference_logps", lambda *a, **k: calls.append(1) or ([], []))
    monkeypatch.setattr(tasks.data, "prepare_split", lambda *a, **k: preparations.append(1))
    record = lambda handles, *rest: scored.extend(h.stage for h in handles) or score_models(handles, *rest)
    monkeypatch.setattr(tasks.evaluate, "score_models", record)
    flow_run_id, report = run_flow(load_config(MINIMAL, UNIQUE))
    states = task_states(flow_run_id)
    assert states["train-sft"] == "Cached"
    assert preparations == []  # the prepared folder exists: read, not prepared again
    assert [s for name, s in states.items() if name.startswith("cache-reference-logps")] == ["Cached"]
    assert states["train-dpo"] == "Completed" and states["train-grpo"] == "Completed"
    assert calls == []
    _, parent, children = parent_and_children(flow_run_id)
    # no new training run: every model is the first run's, reused from its output folder
    assert set(children) == {"evaluate"}
    _, first_parent, first_children = parent_and_children(first_run[0])
    for stage in ("sft", "dpo", "grpo"):
        assert parent.data.tags[f"alignflow.{stage}_run_id"] == first_children[stage].info.run_id
    assert report.rows == first_run[1].rows  # same models, same prompts, same seed
    assert report.per_prompt == first_run[1].per_prompt
    assert scored == []  # the same models: every score comes from the evaluation cache


def test_a_new_dpo_setting_trains_dpo_again_on_the_same_reference_entry(first_run, monkeypatch):
    import trainers.scoring.reference_pass

    calls = []
    monkeypatch.setattr(trainers.scoring.reference_pass, "reference_logps", lambda *a, **k: calls.append(1) or ([], []))
    flow_run_id, _ = run_flow(load_config(MINIMAL, [*UNIQUE, "dpo.learning_rate=0.001"]))
    states = task_states(flow_run_id)
    assert states["train-sft"] == "Cached" and calls == []
    assert [s for name, s in states.items() if name.startswith("cache-reference-logps")] == ["Cached"]
    _, _, children = parent_and_children(flow_run_id)
    assert set(children) == {"dpo", "grpo", "evaluate"}  # GRPO starts from the new DPO model
    first_dpo, second_dpo = (
        mlflow_client().get_run(parent_and_children(run)[2]["dpo"].info.run_id) for run in (first_run[0], flow_run_id)
    )
    assert (
        reference_input(second_dpo)[0].digest == reference_input(first_dpo)[0].digest
    )  # one entry shared by both runs


def test_a_cleared_cache_folder_is_rebuilt_and_never_handed_out_as_a_dead_path(first_run, state_dir, tmp_path):
    """Removing `cache/` (prepared data, built-in models, reference log-probs) costs recomputation,
    never a failed run: the data folder and the reference entry are rebuilt where they were."""
    kept = shutil.move(state_dir / "cache", tmp_path / "cache")  # restored after: session fixtures point into it
    try:
        flow_run_id, report = run_flow(load_config(MINIMAL, UNIQUE))
        states = task_states(flow_run_id)
        assert states["train-sft"] == "Cached" and states["train-dpo"] == "Completed"  # SFT's model is in outputs/
        assert any((state_dir / "cache" / "data").iterdir()) and any((state_dir / "cache" / "reference").iterdir())
        assert report.rows["sft"] == first_run[1].rows["sft"]
    finally:
        shutil.rmtree(state_dir / "cache", ignore_errors=True)
        shutil.move(kept, state_dir / "cache")


def test_grpo_stage_logs_reward_metrics_and_a_completions_table(first_run):
    flow_run_id, report = first_run
    client, parent, children = parent_and_children(flow_run_id)
    grpo = children["grpo"]
    assert grpo.data.params["grpo.num_generations"] == "4"
    # the chain continues from DPO's model, in DPO's content-addressed output folder
    assert re.search(r"/outputs/minimal/dpo-[0-9a-f]{20}/model$", grpo.data.params["policy.init"])
    assert grpo.data.params["data.truncated_prompts.grpo_prompts"] == "0"  # prompts cut, per split
    assert grpo.data.params["data.dropped.grpo_prompts"] == "0"
    for name in (
        "reward",
        "rewards/correctness/mean",
        "completions/mean_length",
        "entropy",
        "time/generation_per_step",
    ):
        assert [m.step for m in client.get_metric_history(grpo.info.run_id, name)] == [2, 4], name
    table_path = mlflow.artifacts.download_artifacts(
        run_id=grpo.info.run_id, artifact_path="completions.json", tracking_uri=get_settings().mlflow_tracking_uri
    )
    table = json.loads(open(table_path).read())
    columns = table["columns"]
    assert {"step", "prompt", "completion", "reward", "rewards/correctness"} <= set(columns)
    steps = [row[columns.index("step")] for row in table["data"]]
    assert sorted(set(steps)) == [2, 4] and len(steps) == 16  # 8 sample rows at each of steps 2 and 4
    evaluated = client.get_run(children["evaluate"].info.run_id).data.metrics["grpo/sampled_accuracy"]
    assert report.rows["grpo"]["sampled_accuracy"] == pytest.approx(evaluated)
    assert (evaluated * 40) == pytest.approx(round(evaluated * 40), abs=1e-6)  # 20 prompts × 2 samples


def test_each_stage_receives_only_its_own_inputs(first_run):
    """The reference-cache entry is DPO's input: the GRPO run that follows neither carries its key
    nor lists it as an input. The evaluation skips implicit rewards for the reference model itself
    (the SFT model, matched by fingerprint) and reports them for every other model."""
    flow_run_id, report = first_run
    client, _, children = parent_and_children(flow_run_id)
    dpo, grpo = (client.get_run(children[name].info.run_id) for name in ("dpo", "grpo"))
    assert "alignflow.reference_cache_key" in dpo.data.tags and len(dpo.inputs.dataset_inputs) == 1
    assert "alignflow.reference_cache_key" not in grpo.data.tags and not grpo.inputs.dataset_inputs
    assert "rewards/accuracies" not in report.rows["sft"]
    assert all("rewards/accuracies" in report.rows[model] for model in ("base", "dpo", "grpo"))


def test_reference_free_objective_runs_with_no_reference_cache_task(prefect_api_url):
    """simpo declares that it needs no reference: under the default `reference: cached` the flow
    runs DPO with no cache-reference-logps task, the DPO run carries no reference-cache key, and
    the evaluation reports no implicit rewards (there is no reference to measure them against)."""
    config = load_config(MINIMAL, ["stages=[dpo]", "dpo.loss_type=simpo", "dpo.beta=2.0"])
    assert config.dpo.reference == "cached"
    flow_run_id, report = run_flow(config)
    states = task_states(flow_run_id)
    assert [name for name in states if name.startswith("cache-reference-logps")] == []
    assert states["train-dpo"] == "Completed"
    client, _, children = parent_and_children(flow_run_id)
    dpo = client.get_run(children["dpo"].info.run_id)
    assert "alignflow.reference_cache_key" not in dpo.data.tags and not dpo.inputs.dataset_inputs
    assert dpo.data.params["dpo.loss_type"] == "simpo"
    assert "rewards/accuracies" not in report.rows["dpo"]


def test_a_grpo_completion_past_the_context_fails_the_run_before_sft_trains(prefect_api_url):
    """The GRPO trainer would refuse it too, but only once SFT and DPO had trained: the flow checks
    every stage's generation once the data is prepared, and no train task runs."""
    from flows.pipeline import experiment

    state = experiment(load_config(MINIMAL, ["grpo.max_completion_length=125"]), return_state=True)
    assert state.is_failed()
    assert (
        "grpo: the longest prompt (4 tokens) + grpo.max_completion_length (125) is 129 tokens, beyond the model's "
        "context (128 positions)" in state.message
    )
    states = task_states(state.state_details.flow_run_id)
    assert [task for name, task in states.items() if name.startswith("prepare-dataset")] == ["Completed"]
    assert [name for name in states if name.startswith(("train-", "cache-reference-logps"))] == []


def test_kto_after_sft_trains_on_the_unpaired_pairs_against_cached_reference_logps_and_is_evaluated(prefect_api_url):
    """The `kto` stage in the flow: SFT's model is its start and its reference, whose log-probs of
    KTO's completions and KL completions (the pairs unpaired: two rows each) are one reference-cache
    entry, listed as the run's input; its MLflow run has KTO's metrics at every logging step, and it
    is evaluated, with the implicit rewards of the held-out pairs (their own reference pass)."""
    overrides = ["stages=[sft, kto]", "kto.max_steps=4", "kto.per_device_train_batch_size=8", "kto.logging_steps=2"]
    flow_run_id, report = run_flow(load_config(MINIMAL, [*UNIQUE, *overrides]))
    states = task_states(flow_run_id)
    assert states["train-kto"] == "Completed" and states["train-sft"] in ("Completed", "Cached")
    assert len([name for name in states if name.startswith("cache-reference-logps")]) == 2  # KTO's rows; held out
    client, _, children = parent_and_children(flow_run_id)
    kto = client.get_run(children["kto"].info.run_id)
    assert kto.info.status == "FINISHED" and kto.data.params["kto.beta"] == "0.1"
    assert kto.data.params["kto.reference"] == "cached"
    entry = ReferenceCache(get_settings().reference_cache_root).read(kto.data.tags["alignflow.reference_cache_key"])
    assert entry.rows == {"kto": 160, "kto_eval": 40} and entry.manifest["inputs"]["view"] == "kto"
    assert reference_input(kto)[0].digest == entry.digest
    assert report.num_pairs == 20 and 0 <= report.rows["kto"]["rewards/accuracies"] <= 1
    assert "rewards/accuracies" not in report.rows["sft"]  # the reference: its implicit reward is 0
    for metric in ("kl", "rewards/chosen", "rewards/rejected", "loss"):
        assert [m.step for m in client.get_metric_history(kto.info.run_id, metric)] == [2, 4], metric
    assert list(report.rows) == ["base", "sft", "kto"]


def test_distill_after_sft_learns_from_a_teacher_folder_and_is_evaluated(prefect_api_url, teacher_checkpoint):
    """The `distill` stage in the flow: SFT's model is the student, the teacher a checkpoint folder
    resolved as a model (named in the run's params, in its stage key); its MLflow run has the
    divergence and the on-policy fraction at every logging step, and it is evaluated."""
    overrides = [
        "stages=[sft, distill]",
        f"distill.teacher_model={teacher_checkpoint.path}",
        "distill.max_steps=4",
        "distill.per_device_train_batch_size=8",
        "distill.logging_steps=2",
        "distill.max_new_tokens=8",
    ]
    flow_run_id, report = run_flow(load_config(MINIMAL, [*UNIQUE, *overrides]))
    states = task_states(flow_run_id)
    assert states["train-distill"] == "Completed"
    client, _, children = parent_and_children(flow_run_id)
    distill = client.get_run(children["distill"].info.run_id)
    assert distill.info.status == "FINISHED" and distill.data.params["distill.lmbda"] == "0.5"
    assert distill.data.params["teacher.path"] == teacher_checkpoint.path
    for metric in ("loss", "on_policy", "completion_length", "logps/teacher", "logps/student"):
        assert [m.step for m in client.get_metric_history(distill.info.run_id, metric)] == [2, 4], metric
    # seed 0, λ = 0.5: steps 0, 1 and 3 sample from the student, step 2 reads the data
    on_policy = [m.value for m in client.get_metric_history(distill.info.run_id, "on_policy")]
    assert on_policy == [1.0, 0.5]
    assert list(report.rows) == ["base", "sft", "distill"]


def test_grpo_scored_by_the_reward_stage_of_the_same_run(prefect_api_url):
    """SFT → reward → GRPO with `model:reward` as its only reward: the reward stage trains a scorer
    from SFT's model (evaluated on the held-out pairs), the policy passes it by (GRPO starts from
    SFT's model), GRPO logs the reward model's scores, and the report has no row for the scorer.
    The reward model is configs/rlhf.yaml's: the likelihood head (the classifier's scoring after a
    save is tests/test_reward_model.py's). The promotion gate reads the reward model's score."""
    overrides = [
        "stages=[sft, reward, grpo]",
        "reward.head=likelihood",
        "reward.max_steps=4",
        "reward.logging_steps=2",
        "reward.eval_strategy=steps",
        "reward.eval_steps=4",
        "grpo.reward_funcs=[model:reward]",
        "evaluation.reward_model=reward",
        "promotion.registered_model=rm-gated",
        "promotion.metric=reward_model_score",
        "promotion.min_value=null",  # mean log-probs are negative
    ]
    flow_run_id, report = run_flow(load_config(MINIMAL, [*UNIQUE, *overrides]))
    states = task_states(flow_run_id)
    assert states["train-reward"] == "Completed" and states["train-grpo"] == "Completed"
    client, _, children = parent_and_children(flow_run_id)
    reward = client.get_run(children["reward"].info.run_id)
    assert reward.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(reward.info.run_id, "accuracy")] == [2, 4]
    assert set(STAGES["reward"].curves) <= reward.data.metrics.keys()
    assert [m.step for m in client.get_metric_history(reward.info.run_id, "eval_accuracy")] == [4]
    grpo = client.get_run(children["grpo"].info.run_id)
    scores = client.get_metric_history(grpo.info.run_id, "rewards/model:reward/mean")
    assert [m.step for m in scores] == [2, 4] and all(math.isfinite(m.value) for m in scores)
    assert all(m.value < 0 for m in scores)  # mean log-probs: the saved causal LM scored as a likelihood model
    # both start from SFT's model; GRPO names the reward stage's
    assert (
        grpo.data.params["policy.init"] == reward.data.params["policy.init"] != grpo.data.params["reward_models.reward"]
    )
    assert grpo.data.params["reward_models.reward"].startswith(
        reward.data.params["policy.init"].split("/sft-")[0] + "/reward-"
    )
    assert list(report.rows) == ["base", "sft", "grpo"]
    # the evaluation scores every model's samples by the reward stage's model: mean log-probs
    assert all(row["reward_model_score"] < 0 for row in report.rows.values())
    assert "| RM score |" in report.markdown()
    evaluate_run = client.get_run(children["evaluate"].info.run_id)
    assert evaluate_run.data.metrics["grpo/reward_model_score"] == pytest.approx(
        report.rows["grpo"]["reward_model_score"]
    )
    promotion = client.get_run(evaluate_run.data.tags["mlflow.parentRunId"]).data.tags["alignflow.promotion"]
    assert promotion.startswith("promoted: rm-gated version 1") and "reward_model_score = " in promotion
    champion = client.get_model_version_by_alias("rm-gated", "champion")
    assert champion.run_id == grpo.info.run_id
    assert float(champion.tags["eval.reward_model_score"]) == pytest.approx(
        report.rows["grpo"]["reward_model_score"], rel=1e-5
    )


def test_a_flow_run_that_skipped_the_cli_fails_in_seconds_when_the_tracking_server_does_not_answer(
    prefect_api_url, monkeypatch
):
    """As a worker's or a served deployment's run: the flow asks the server itself, before its parent run."""
    from flows.pipeline import experiment

    monkeypatch.setenv("ALIGNFLOW_TRACKING_URI", "http://alice:s3cret@127.0.0.1:1")
    started = time.monotonic()
    state = experiment(load_config(MINIMAL, UNIQUE), return_state=True)
    assert time.monotonic() - started < 15
    assert state.is_failed()
    error = state.result(raise_on_failure=False)
    assert isinstance(error, TrackingServerUnreachable)
    assert "http://alice:***@127.0.0.1:1 does not answer (" in str(error) and "s3cret" not in str(error)
