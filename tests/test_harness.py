"""lm-evaluation-harness suites in the evaluation: the harness's own numbers, offline data, the
cache, the promotion gate, and what alignflow reads of the harness (``lm_eval_compat``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import choice_task, mlflow_client

from infra.core.config import EvaluationRequest, ExperimentConfig, load_config
from tasks.evaluate import EvalReport, check_suites
from tasks.promote import gate
from trainers.evaluation.harness import SuiteError, SuiteRequest, metric_name, resolve_suite


def saved_models(tmp_path: Path) -> dict[str, Path]:
    from trainers.models.builtin import save_builtin_model

    return {
        name: save_builtin_model("builtin:tiny-llama", seed, tmp_path / name) for name, seed in (("a", 0), ("b", 1))
    }


def cli_results(model: Path, task: Path, output: Path) -> dict[str, float]:
    """What ``lm-eval run`` reports for ``model`` on ``task``, named as alignflow names suite metrics."""
    command = [
        sys.executable, "-m", "lm_eval", "run", "--model", "hf",
        "--model_args", f"pretrained={model},dtype=float32", "--device", "cpu",
        "--tasks", str(task), "--batch_size", "16", "--seed", "0", "--apply_chat_template",
        "--output_path", str(output),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin"})
    assert done.returncode == 0, done.stdout + done.stderr
    (written,) = output.rglob("results_*.json")
    results = json.loads(written.read_text())["results"]["addition_choice"]
    return {
        name: float(value)
        for key, value in results.items()
        if (name := metric_name("addition_choice", key)) is not None and isinstance(value, float)
    }


@pytest.mark.flow
def test_alignflow_evaluate_reports_what_the_harness_cli_prints_and_a_rerun_skips_the_harness(
    prefect_api_url, tmp_path, monkeypatch
):
    from flows.evaluation import evaluation

    task, models = choice_task(tmp_path), saved_models(tmp_path)
    minimal = load_config("configs/minimal.yaml")
    request = EvaluationRequest(
        name="harness-eval",
        models={label: str(path) for label, path in models.items()},
        data=minimal.data,
        evaluation=minimal.evaluation.model_dump() | {"suites": [{"task": str(task)}, {"task": "builtin:addition"}]},
        tracking={"experiment_name": "harness-cli"},
    )
    (tmp_path / "request.yaml").write_text(yaml.safe_dump(request.model_dump(mode="json")))
    env = {**os.environ, "PREFECT_API_URL": prefect_api_url, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "infra.ops.cli", "evaluate", str(tmp_path / "request.yaml")]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    client = mlflow_client()
    (parent,) = client.search_runs(
        [client.get_experiment_by_name("harness-cli").experiment_id], "tags.`alignflow.kind` = 'evaluation'"
    )
    logged = parent.data.metrics

    def harness_must_not_run(*args, **kwargs):
        raise AssertionError("a cached model's suites ran again")

    monkeypatch.setattr("trainers.evaluation.harness.run_task", harness_must_not_run)
    report = evaluation(request)  # the same request again, in this process: every model from the cache

    for label, path in models.items():
        expected = cli_results(path, task, tmp_path / f"cli-{label}")
        assert set(expected) == {
            f"addition_choice/{m}/none" for m in ("acc", "acc_stderr", "acc_norm", "acc_norm_stderr")
        }
        assert {name: logged[f"eval/{label}/{name}"] for name in expected} == pytest.approx(expected, rel=1e-12)
        assert {name: report.rows[label][name] for name in expected} == expected
        # the built-in task as a harness task: the same held-out prompts, greedy, as the built-in greedy accuracy
        assert report.rows[label]["addition/exact_match/none"] == report.rows[label]["greedy_accuracy"]
        assert len(report.per_prompt[label]["addition_choice/acc/none"]) == 30
    assert report.rows["a"]["addition_choice/acc/none"] != report.rows["b"]["addition_choice/acc/none"]
    assert "addition_choice/acc/none" in report.markdown()
    assert report.suite_metrics == [
        "addition/exact_match/none", "addition_choice/acc/none", "addition_choice/acc_norm/none"
    ]  # fmt: skip


@pytest.mark.flow
def test_a_suite_task_that_would_download_fails_the_evaluation_before_any_model_is_scored(
    prefect_api_url, tmp_path, monkeypatch
):
    from flows.evaluation import evaluation

    def no_scoring(*args, **kwargs):
        raise AssertionError("a model was scored")

    monkeypatch.setattr("tasks.evaluate.score_models", no_scoring)
    request = EvaluationRequest(
        name="harness-offline",
        models={"a": "builtin:tiny-llama"},
        data=load_config("configs/minimal.yaml").data,
        evaluation={"num_prompts": 4, "suites": [{"task": "builtin:addition"}, {"task": "arc_easy"}]},
        tracking={"experiment_name": "harness-test"},
    )
    state = evaluation(request, return_state=True)
    assert state.is_failed()
    with pytest.raises(SuiteError, match=r"evaluation.suites\[1\] \(arc_easy\): its data is the hub dataset"):
        state.result()


@pytest.mark.unit
def test_suite_data_is_checked_before_anything_runs(tmp_path):
    task = choice_task(tmp_path)
    (tmp_path / "choice.jsonl").unlink()
    with pytest.raises(SuiteError, match=r"evaluation.suites\[0\] \(addition_choice\): data file\(s\) not found"):
        resolve_suite(SuiteRequest(str(task), "evaluation.suites[0]"), tmp_path)
    with pytest.raises(SuiteError, match=r"evaluation.suites\[0\]: builtin:addition scores the built-in task"):
        resolve_suite(SuiteRequest("builtin:addition", "evaluation.suites[0]"), tmp_path, [])
    check_suites(ExperimentConfig().evaluation, None)  # no suites: nothing to check


@pytest.mark.unit
def test_local_data_replaces_a_registered_tasks_hub_dataset_and_its_contents_make_the_fingerprint(tmp_path):
    from trainers.evaluation.harness import SuiteData

    rows = tmp_path / "arc.jsonl"
    row = {"id": "1", "question": "2+2?", "choices": {"text": ["3", "4"], "label": ["A", "B"]}, "answerKey": "B"}
    rows.write_text(json.dumps(row) + "\n")
    request = SuiteRequest("arc_easy", "evaluation.suites[0]", SuiteData("json", {"test": str(rows)}))
    first = resolve_suite(request, tmp_path)
    assert first.name == "arc_easy"
    assert first.config["dataset_path"] == "json"
    assert first.config["dataset_kwargs"]["data_files"] == {"test": str(rows)}
    assert "dataset_name" not in first.config  # the hub dataset's configuration goes with it
    moved = tmp_path / "moved.jsonl"
    moved.write_text(rows.read_text())
    same = resolve_suite(SuiteRequest("arc_easy", "x", SuiteData("json", {"test": str(moved)})), tmp_path)
    assert same.fingerprint == first.fingerprint  # where the file lies is not what the scores depend on
    moved.write_text(json.dumps(row | {"answerKey": "A"}) + "\n")
    assert resolve_suite(
        SuiteRequest("arc_easy", "x", SuiteData("json", {"test": str(moved)})), tmp_path
    ).fingerprint != (first.fingerprint)


@pytest.mark.unit
def test_promotion_metric_may_name_a_suite_metric_and_the_gate_promotes_by_it():
    suites = {"evaluation": {"suites": [{"task": "builtin:addition"}]}}
    promotion = {"registered_model": "m", "metric": "addition/exact_match/none", "confidence": 0.9}
    config = ExperimentConfig.model_validate(suites | {"promotion": promotion})
    with pytest.raises(ValueError, match="or a metric of a task of evaluation.suites"):
        ExperimentConfig.model_validate(suites | {"promotion": promotion | {"metric": "gsm8k/exact_match/none"}})

    def report(candidate: list[float], champion: list[float]) -> EvalReport:
        rows = {
            label: {"addition/exact_match/none": sum(v) / len(v)}
            for label, v in (("dpo", candidate), ("champion", champion))
        }
        per_prompt = {
            label: {"addition/exact_match/none": v} for label, v in (("dpo", candidate), ("champion", champion))
        }
        return EvalReport(rows=rows, num_prompts=0, num_pairs=0, mlflow_run_id="r", per_prompt=per_prompt)

    promoted, reason = gate(report([1.0] * 40, [0.0] * 40), "dpo", config.promotion, None)
    assert promoted and reason == "first champion: addition/exact_match/none = 1.0000"
    promoted, reason = gate(report([0.0] * 40, [0.0] * 40), "dpo", config.promotion, None)
    assert not promoted and "promotion.min_value" in reason


@pytest.mark.unit
def test_lm_eval_compat_reads_task_files_and_the_registry(tmp_path):
    """The contract of ``trainers.evaluation.lm_eval_compat`` with the installed harness."""
    from trainers.evaluation.lm_eval_compat import registered_task_file, task_yaml

    base = tmp_path / "base.yaml"
    base.write_text("dataset_path: json\noutput_type: generate_until\ndoc_to_text: '{{q}}'\n")
    (tmp_path / "child.yaml").write_text("include: base.yaml\ntask: child\ndoc_to_text: '{{p}}'\n")
    assert task_yaml(tmp_path / "child.yaml", resolve_functions=False) == {
        "dataset_path": "json", "output_type": "generate_until", "doc_to_text": "{{p}}", "task": "child"
    }  # fmt: skip
    gsm8k = registered_task_file("gsm8k")
    assert gsm8k is not None and gsm8k.name == "gsm8k.yaml"
    assert task_yaml(gsm8k, resolve_functions=False)["dataset_path"] == "openai/gsm8k"
    assert registered_task_file("mmlu") is None  # a group
    assert registered_task_file("no-such-task") is None


@pytest.mark.slow  # the harness runs `git describe`
def test_the_builtin_harness_task_sees_the_prompt_tokens_the_pipeline_trains_and_scores(tiny, tmp_path):
    """``builtin:addition``'s requests are the held-out prompts as the pipeline tokenizes them (plain
    text, no chat template), and its targets their answers."""
    from trainers.data.rows import render_prompt
    from trainers.data.synthetic import AdditionTask, generate_addition
    from trainers.evaluation.harness import run_task

    model, tokenizer = tiny
    rows = generate_addition(AdditionTask(max_operand=9, num_eval_problems=6))["eval_prompts"]
    task = resolve_suite(SuiteRequest("builtin:addition", "evaluation.suites[0]"), tmp_path, rows)
    samples = sorted(run_task(model, tokenizer, task, seed=0)["samples"]["addition"], key=lambda s: s["doc_id"])
    assert [tokenizer(s["arguments"][0][0]).input_ids for s in samples] == [
        render_prompt(tokenizer, row["prompt"]) for row in rows
    ]
    assert [s["target"] for s in samples] == [row["answer"] for row in rows]
