"""lm-evaluation-harness suites with ``evaluation.generation_backend: vllm``: the harness's vLLM
backend runs on the evaluation's own engine (``trainers.evaluation.lm_eval_vllm``), and scores what
the harness's vLLM backend scores with an engine it builds itself.

Runs in the vLLM environment (``.venv-vllm``), like ``tests/test_vllm.py``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from helpers import assert_suites_as_one_process, choice_task

from infra.core.config import AdditionTaskConfig, ComputeConfig, EvaluationConfig, ExperimentConfig
from infra.core.ports import free_port
from trainers.data.rows import Truncation, tokenize_split
from trainers.data.synthetic import AdditionTask, generate_addition
from trainers.evaluation import evaluate as evaluation
from trainers.evaluation.harness import HarnessScores, HarnessTask, add_task_scores, run_task

pytestmark = pytest.mark.vllm


def suites(tmp_path: Path) -> tuple[EvaluationConfig, tuple[HarnessTask, ...]]:
    """An evaluation on vLLM with a multiple-choice task from local files (log-likelihoods) and the
    built-in addition task (greedy generation), resolved."""
    config = EvaluationConfig(
        generation_backend="vllm",
        num_prompts=12,
        max_new_tokens=4,
        num_samples=2,
        suites=[{"task": str(choice_task(tmp_path))}, {"task": "builtin:addition"}],
    )
    folder = tmp_path / "suites"
    folder.mkdir()
    return config, config.resolved_suites(ExperimentConfig().data.builtin, folder)


def own_vllm_backend(checkpoint: Path, seed: int):
    """The harness's vLLM backend as ``lm-eval --model vllm`` builds it: an engine of its own from the folder."""
    from lm_eval.models.vllm_causallms import VLLM

    return VLLM(pretrained=str(checkpoint), dtype="float32", enforce_eager=True, batch_size=16, seed=seed)


def own_backend_output(lm, task: HarnessTask, seed: int) -> dict:
    """``simple_evaluate`` of ``task`` on ``lm`` with the settings :func:`run_task` gives it."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(
        model=lm,
        tasks=[task.config],
        task_manager=TaskManager(include_defaults=False),
        apply_chat_template=task.request.task != "builtin:addition",
        log_samples=True,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
    )


def responses(output: dict, task: HarnessTask) -> list:
    """What the model answered to each document: texts, or (log-likelihood, is greedy) per choice."""
    return [sample["filtered_resps"] for sample in output["samples"][task.name]]


def test_suites_on_vllm_share_the_evaluations_engine_and_score_what_the_harness_vllm_backend_scores(
    tiny, tiny_checkpoint, tmp_path, monkeypatch
):
    from trainers.evaluation.lm_eval_vllm import EngineLM

    model, tokenizer = tiny
    config, tasks = suites(tmp_path)
    rows = generate_addition(AdditionTask(max_operand=9, num_eval_problems=12))["eval_prompts"]
    prompts, _ = tokenize_split(rows, "eval_prompts", tokenizer, Truncation(32, 16))
    engines = []

    def recorded(seed, replaceable=True):
        engines.append(evaluation.ReusedEngine(evaluation.EVALUATION_ENGINE, seed, replaceable))
        return engines[-1]

    monkeypatch.setattr(evaluation, "evaluation_engine", recorded)
    scores = evaluation.evaluate_model(model, tokenizer, prompts, None, config.spec(False, tasks), None)
    # one engine for the model's completions and both suites, served once: built, never synced
    (engine,) = engines
    assert (engine.builds, engine.models, engine.engine) == (1, 1, None)

    seed = config.seed
    own = own_vllm_backend(Path(tiny_checkpoint.path), seed)
    expected = HarnessScores({}, {})
    for task in tasks:
        output = own_backend_output(own, task, seed)
        add_task_scores(expected, task, output)
        # the harness's requests on an engine alignflow built, here the one lm-eval built (it detokenizes
        # itself; the evaluation's engine does not): every answer, text and log-likelihood, is its own
        assert responses(run_task(model, tokenizer, task, seed, llm=own.model), task) == responses(output, task)
    assert set(expected.metrics) == {
        "addition/exact_match/none", "addition/exact_match_stderr/none", "addition_choice/acc/none",
        "addition_choice/acc_stderr/none", "addition_choice/acc_norm/none", "addition_choice/acc_norm_stderr/none",
    }  # fmt: skip
    assert {name: scores.metrics[name] for name in expected.metrics} == expected.metrics
    assert {name: scores.per_prompt[name] for name in expected.per_prompt} == expected.per_prompt
    assert len(scores.per_prompt["addition_choice/acc/none"]) == 30
    # what lm-eval's VLLM sets when it builds its engine, EngineLM sets around one given to it
    assert set(vars(EngineLM(own.model, model, tokenizer, 16))) - {"state"} == set(vars(own))


def test_suites_on_vllm_over_two_processes_score_what_one_process_scores(
    tiny_checkpoint, teacher_checkpoint, tmp_path, monkeypatch
):
    """Two launched processes, each with an engine of its own, each running its share of the
    harness's requests: what one process scores."""
    from tasks.evaluate import Scoring, score_models

    builtin = AdditionTaskConfig(max_operand=9, num_eval_problems=20)
    tasks = [{"task": str(choice_task(tmp_path)), "batch_size": 4}, {"task": "builtin:addition", "batch_size": 4}]
    config = EvaluationConfig(generation_backend="vllm", num_prompts=7, suites=tasks)
    resolved = config.resolved_suites(builtin, tmp_path)
    models = [tiny_checkpoint, teacher_checkpoint]
    scoring = Scoring([], None, config, None, ComputeConfig(cpu=True), suites=resolved, builtin=builtin)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with evaluation.evaluation_engine(config.seed) as engines:
        one = list(score_models(models, scoring, engines))
    two_processes = ComputeConfig(cpu=True, num_processes=2, main_process_port=free_port())
    two = list(score_models(models, dataclasses.replace(scoring, compute=two_processes)))
    assert_suites_as_one_process(two, one)
    assert one[0].per_prompt["addition_choice/acc/none"] != one[1].per_prompt["addition_choice/acc/none"]


def test_an_adapter_folder_is_served_merged_and_scores_what_its_merged_copy_scores(tiny_checkpoint, tmp_path):
    """A LoRA adapter folder loads as its base with the adapter's layers in it; the evaluation's engine
    serves it merged (``W + (α/r)·B·A``): its completions and suites are its merged copy's, not its base's."""
    import torch

    from trainers.models.lora import LoraSettings, add_adapters
    from trainers.models.pretrained import load_causal_lm

    base, tokenizer = load_causal_lm(tiny_checkpoint.path)
    policy = add_adapters(base, LoraSettings(r=4, alpha=8.0))
    with torch.no_grad():  # B = 0 at the start: an adapter that changes the model
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(len(name)))
    policy.save_pretrained(tmp_path / "adapter")
    tokenizer.save_pretrained(tmp_path / "adapter")
    merged = policy.merge_and_unload()
    adapter, _ = load_causal_lm(str(tmp_path / "adapter"))
    unadapted, _ = load_causal_lm(tiny_checkpoint.path)
    config, tasks = suites(tmp_path)
    rows = generate_addition(AdditionTask(max_operand=9, num_eval_problems=12))["eval_prompts"]
    prompts, _ = tokenize_split(rows, "eval_prompts", tokenizer, Truncation(32, 16))
    spec = config.spec(False, tasks)
    with evaluation.evaluation_engine(config.seed) as engines:
        scored = [
            evaluation.evaluate_model(model, tokenizer, prompts, None, spec, None, engines=engines)
            for model in (adapter, merged, unadapted)
        ]
        assert engines.builds == 1  # one shape: synced in
    assert scored[0] == scored[1]
    assert scored[0].samples != scored[2].samples
    assert scored[0].per_prompt["addition_choice/acc/none"] != scored[2].per_prompt["addition_choice/acc/none"]
