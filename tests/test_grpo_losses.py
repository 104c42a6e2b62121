"""GRPO math against formulas written out here: advantages, clipping, k3, each loss_type, rewards."""

import math
import statistics

import pytest
import torch

from trainers.grpo_losses import (
    clip_fractions,
    clipped_surrogate,
    get_grpo_loss,
    group_advantages,
    k3_kl,
    weighted_rewards,
)
from trainers.rewards import REWARD_FUNCTIONS, get_reward, score_completions

REWARDS = [1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 0.0, 0.0, 0.0, 3.0]  # 3 prompts x G = 4


def test_group_advantages_group_batch_and_none():
    groups = [REWARDS[i : i + 4] for i in range(0, 12, 4)]
    eps = 1e-4
    expected_group = [(r - statistics.mean(g)) / (statistics.stdev(g) + eps) for g in groups for r in g]
    expected_batch = [(r - statistics.mean(g)) / (statistics.stdev(REWARDS) + eps) for g in groups for r in g]
    expected_none = [r - statistics.mean(g) for g in groups for r in g]
    rewards = torch.tensor(REWARDS)
    assert group_advantages(rewards, 4, "group").tolist() == pytest.approx(expected_group, abs=1e-5)
    assert group_advantages(rewards, 4, "batch").tolist() == pytest.approx(expected_batch, abs=1e-5)
    assert group_advantages(rewards, 4, "none").tolist() == pytest.approx(expected_none, abs=1e-6)
    assert group_advantages(rewards, 4, "group")[4:8].tolist() == [0.0] * 4  # equal rewards carry no signal
    with pytest.raises(ValueError, match="unknown scale_rewards 'rank'"):
        group_advantages(rewards, 4, "rank")


def test_clipping_with_hand_made_ratios():
    ratios = [0.5, 0.9, 1.0, 1.1, 1.5]
    logps = torch.tensor([[math.log(r) for r in ratios]] * 2, requires_grad=True)
    old = torch.zeros(2, 5)
    advantages = torch.tensor([1.0, -1.0])
    loss = clipped_surrogate(logps, old, advantages, epsilon_low=0.2, epsilon_high=0.28)
    # A = +1: −min(ρ, clip(ρ, 0.8, 1.28)); A = −1: max(ρ, clip(ρ, 0.8, 1.28))
    assert loss[0].tolist() == pytest.approx([-0.5, -0.9, -1.0, -1.1, -1.28], abs=1e-6)
    assert loss[1].tolist() == pytest.approx([0.8, 0.9, 1.0, 1.1, 1.5], abs=1e-6)
    loss.sum().backward()
    # d/dlogp of −Aρ is −Aρ where the unclipped term is the minimum, 0 where the clip binds
    assert logps.grad[0].tolist() == pytest.approx([-0.5, -0.9, -1.0, -1.1, 0.0], abs=1e-6)
    assert logps.grad[1].tolist() == pytest.approx([0.0, 0.9, 1.0, 1.1, 1.5], abs=1e-6)
    low, high = clip_fractions(logps.detach(), old, advantages, torch.ones(2, 5), 0.2, 0.28)
    assert (low.item(), high.item()) == pytest.approx((0.1, 0.1))


def test_k3_kl_formula():
    logps, ref = torch.tensor([[-1.0, -2.0, -0.5]]), torch.tensor([[-1.5, -2.0, 0.0]])
    expected = [math.exp(d) - d - 1 for d in (-0.5, 0.0, 0.5)]
    assert k3_kl(logps, ref)[0].tolist() == pytest.approx(expected, abs=1e-6)


PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 5.0, 100.0, 100.0], [7.0, 100.0, 100.0, 100.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])  # row 3 counts nothing


@pytest.mark.parametrize(
    "loss_type, expected",
    [
        ("grpo", ((1 + 2 + 3) / 3 + (4 + 5) / 2 + 0) / 3),  # mean over sequences of token means
        ("bnpo", (1 + 2 + 3 + 4 + 5) / 5),  # mean over counted tokens
        ("dr_grpo", (1 + 2 + 3 + 4 + 5) / (3 * 8)),  # sum / (B · max_completion_length)
        ("dapo", (1 + 2 + 3 + 4 + 5) / 7.5),  # sum / (generation batch tokens per step)
    ],
)
def test_each_loss_type_against_its_formula(loss_type, expected):
    loss = get_grpo_loss(loss_type)(PER_TOKEN, MASK, max_completion_length=8, tokens_per_step=7.5)
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def test_unknown_loss_types_and_reward_scales_are_rejected_by_name():
    with pytest.raises(ValueError, match="unknown loss_type 'ppo'"):
        get_grpo_loss("ppo")
    with pytest.raises(ValueError, match="unknown scale_rewards 'mad'"):
        group_advantages(torch.tensor(REWARDS), 4, "mad")


def test_builtin_rewards_none_rows_and_weighted_sum():
    completions = ["68", " 68 ", "67", "6 8", "abc"]
    answers = ["68", "68", "68", None, "1"]
    ids = [[1, 2], [1, 2, 3, 4], [1, 2], [1, 2, 3], [1, 2, 3]]
    functions = [(n, get_reward(n)) for n in ("correctness", "format", "length_penalty")]
    scores = torch.tensor(
        score_completions(functions, ["p"] * 5, completions, {"answer": answers, "completion_ids": ids})
    )
    assert scores[0, :3].tolist() == [1.0, 1.0, 0.0] and math.isnan(scores[0, 3]) and scores[0, 4] == 0.0
    assert scores[1].tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert scores[2].tolist() == [-2.0, -4.0, -2.0, -3.0, -3.0]
    total = weighted_rewards(scores, torch.tensor([1.0, 0.5, 0.1]))
    # row 3: correctness is None and is left out of the sum rather than poisoning it
    assert total.tolist() == pytest.approx([1.3, 1.1, 0.3, -0.3, -0.3], abs=1e-6)


def test_reward_names_resolve_by_registry_or_import_path():
    assert get_reward("format") is REWARD_FUNCTIONS["format"]
    assert get_reward("trainers.rewards:length_penalty") is REWARD_FUNCTIONS["length_penalty"]
    assert get_reward("trainers.rewards.correctness") is REWARD_FUNCTIONS["correctness"]
    with pytest.raises(ValueError, match="unknown reward function 'nope'"):
        get_reward("nope")
    with pytest.raises(ValueError, match="'trainers.rewards:missing' cannot be imported"):
        get_reward("trainers.rewards:missing")
    with pytest.raises(ValueError, match="needs a dataset column 'answer'"):
        get_reward("correctness")(["p"], ["1"])
    with pytest.raises(ValueError, match="'format' returned 1 values for 2 completions"):
        score_completions([("format", lambda prompts, completions, **_: [1.0])], ["p", "q"], ["1", "2"], {})
