"""``data.chat_template`` is the tokenizer's template everywhere the data is used, not only where it is
prepared: a GRPO stage's rollouts and an evaluation's answers stop at the override's end of turn, and
the model a stage saves carries the override. The model is a real checkpoint whose own template ends
a turn with ``<|im_end|>``; the override ends it with ``<|eot|>``, and the model writes both."""

from __future__ import annotations

import json

import datasets
import pytest
from helpers import chat_tokenizer
from policies import scripted_checkpoint
from prefect.logging import disable_run_logger

from infra.core.config import ComputeConfig, DataConfig, DatasetSource, EvaluationConfig
from infra.core.ports import free_port
from infra.core.stage_io import TrainInputs
from tasks.data import prepare_dataset
from tasks.evaluate import Scoring, score_models
from tasks.models import checkpoint_handle
from tasks.stage_trainer import stage_inputs
from trainers.catalog import STAGES
from trainers.grpo.section import GRPOStageConfig
from trainers.models.pretrained import load_tokenizer

OVERRIDE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|eot|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# What the policy writes after the generation prompt's newline: the override's end of turn, then its own.
WRITES = ["f", "h", "<|eot|>", "b", "d", "<|im_end|>"]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The checkpoint's handle and data prepared with the override (GRPO prompts and held-out prompts)."""
    folder = tmp_path_factory.mktemp("override")
    tokenizer = chat_tokenizer("chatml")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|eot|>"]})
    policy = checkpoint_handle(scripted_checkpoint(tokenizer, WRITES, folder / "model"), "base")
    rows = folder / "prompts.jsonl"
    row = {"prompt": [{"role": "user", "content": "2+2?"}], "answer": "fh"}
    rows.write_text("\n".join(json.dumps(row) for _ in range(2)) + "\n")
    source = DatasetSource(path=str(rows))
    config = DataConfig(builtin=None, grpo_prompts=source, eval_prompts=source, chat_template=OVERRIDE)
    with disable_run_logger():
        data = prepare_dataset.fn(config, policy)
    return policy, data, tokenizer


def ids(tokenizer, *tokens: str) -> list[int]:
    return tokenizer.convert_tokens_to_ids(list(tokens))


@pytest.mark.unit
def test_the_prepared_data_names_the_override(prepared):
    _, data, _ = prepared
    assert data.chat_template == OVERRIDE


@pytest.mark.unit
def test_grpo_rollouts_stop_at_the_overrides_end_of_turn_and_the_saved_model_carries_it(prepared, tmp_path):
    policy, data, tokenizer = prepared
    section = GRPOStageConfig(per_device_train_batch_size=2, num_generations=2, max_completion_length=8)
    inputs = stage_inputs("grpo", TrainInputs(policy, data), str(tmp_path), [])
    trainer = STAGES["grpo"].build(section, inputs)
    assert trainer.stop_ids == tuple(ids(tokenizer, "<|endoftext|>", "<|eot|>"))
    rows = [dict(r) for r in inputs.splits["grpo_prompts"]]
    (batch,) = trainer.generate_and_score(trainer.model, rows)
    prompt = rows[0]["prompt_ids"]
    assert batch["input_ids"].tolist() == [prompt + ids(tokenizer, "f", "h", "<|eot|>")] * 2
    trainer.save_model(str(tmp_path / "saved"))
    assert load_tokenizer(str(tmp_path / "saved")).chat_template == OVERRIDE


def scoring(data, processes: int) -> Scoring:
    evaluation = EvaluationConfig(num_samples=1, max_new_tokens=8)
    prompts = [dict(r) for r in datasets.load_from_disk(data.path)["eval_prompts"]]
    compute = ComputeConfig(cpu=True, num_processes=processes, main_process_port=free_port())
    return Scoring(prompts, None, evaluation, None, compute, chat_template=data.chat_template)


@pytest.mark.unit
def test_evaluation_answers_stop_at_the_overrides_end_of_turn(prepared):
    policy, data, _ = prepared
    (scores,) = score_models([policy], scoring(data, 1))
    assert scores.samples["completion"] == ["fh", "fh"]
    assert scores.metrics["greedy_accuracy"] == 1.0


@pytest.mark.slow
def test_a_launched_evaluation_stops_at_the_overrides_end_of_turn_too(prepared, monkeypatch):
    """Over two processes (``tasks.evaluate.launched_scores``): the launch spec carries the override."""
    policy, data, _ = prepared
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    (scores,) = score_models([policy], scoring(data, 2))
    assert scores.samples["completion"] == ["fh", "fh"]
