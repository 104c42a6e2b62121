"""Asynchronous GRPO (``max_staleness``, ``trainers/grpo/ahead.py``) on a managed vLLM server: batches
sampled ahead while the trainer trains, never more than k rounds old, on the prompts the trainer's
dataloader gives; and the arguments it needs. Runs in the vLLM environment (``.venv-vllm``)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import datasets
import pytest
from policies import SHORT_GRPO, grpo_args

from infra.core.generation_server import managed_generation_server
from trainers.data.rows import Truncation, tokenize_split
from trainers.data.synthetic import AdditionTask, generate_addition
from trainers.grpo.trainer import GRPOTrainer
from trainers.models.builtin import build_builtin_model

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[tuple[str, Path]]:
    root = tmp_path_factory.mktemp("vllm-server")
    with managed_generation_server(root, lambda line: None) as url:
        yield url, root


class RecordedTrainer(GRPOTrainer):
    """Records the prompts of every generation round, as the dataloader gives them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rounds: list[list[list[int]]] = []

    def generate(self, model, prompts):
        self.rounds.append(prompts)
        return super().generate(model, prompts)


def trainer(tmp_path: Path, server: tuple[str, Path], **settings) -> RecordedTrainer:
    model, tokenizer = build_builtin_model("builtin:tiny-llama", seed=0)
    rows = generate_addition(AdditionTask(max_operand=9, num_eval_problems=20))["grpo_prompts"]
    prompts, _ = tokenize_split(rows, "grpo_prompts", tokenizer, Truncation(32, 16))
    url, root = server
    engine = dict(generation_backend="vllm", vllm_mode="server", vllm_server_url=url, vllm_transfer_folder=str(root))
    return RecordedTrainer(
        model=model,
        args=grpo_args(tmp_path, **SHORT_GRPO, seed=1, generation_seed=3, **engine, **settings),
        train_dataset=datasets.Dataset.from_list(prompts),
        processing_class=tokenizer,
        reward_funcs=[lambda prompts, completions, **_: [float(sum(map(ord, c)) % 7) for c in completions]],
    )


@pytest.mark.parametrize("staleness", [1, 2])
def test_batches_sampled_ahead_are_at_most_k_rounds_old_and_the_dataloaders_own(tmp_path, server, staleness):
    """Rounds of 2 steps (``steps_per_generation`` 2): round 0 is sampled in the round (nothing was
    asked before it), each later round g was asked at the start of round max(g − k, 0), from the
    weights of that round's first step, so the slice trained at step s is s − that step old. The
    weights are pushed once a round after the first, while the server is idle."""
    settings = dict(max_steps=10, steps_per_generation=2, vllm_importance_sampling_cap=3.0)
    ahead = trainer(tmp_path / "ahead", server, max_staleness=staleness, **settings)
    ahead.train()
    logs = [log for log in ahead.state.log_history if "loss" in log]
    sampled_at = [2 * max(g - staleness, 0) for g in range(5)]  # the step whose weights sampled round g
    expected = [float(step - sampled_at[step // 2]) for step in range(10)]
    assert [log["staleness/steps_max"] for log in logs] == expected
    assert max(expected) == 2 * staleness + 1  # k rounds of 2 steps, and the round's second step
    assert ahead.ahead is not None and ahead.ahead.taken == 4 and ahead.generation_calls == 5
    assert ahead.backend.engine is not None and ahead.backend.engine.syncs == 4
    # every round trained on the prompts the dataloader gave it: the synchronous run's, in order
    synchronous = trainer(tmp_path / "sync", server, **settings)
    synchronous.train()
    assert ahead.rounds == synchronous.rounds and len({str(r) for r in ahead.rounds}) == 5
    assert all(log["vllm/is_ratio_max"] <= 3.0 for log in logs)


def test_sampling_ahead_needs_a_server_and_the_importance_sampling_correction(tmp_path):
    common = dict(SHORT_GRPO, max_staleness=1)
    with pytest.raises(
        ValueError, match="max_staleness: 1 samples ahead on a vLLM server: it needs generation_backend"
    ):
        grpo_args(tmp_path, **common)
    server = dict(generation_backend="vllm", vllm_mode="server", vllm_server_url="http://127.0.0.1:1")
    with pytest.raises(ValueError, match="needs the importance-sampling correction: set vllm_importance_sampling_cap"):
        grpo_args(tmp_path, **common, **server)
    assert grpo_args(tmp_path, **common, **server, vllm_importance_sampling_cap=2.0).reuses_generations
