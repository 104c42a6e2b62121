"""GRPO's off-policy corrections (``trainers/grpo/off_policy.py``) against their formulas, written
here as TRL computes them (``vllm_importance_sampling_mode``, ``off_policy_mask_threshold``)."""

import math

import pytest
import torch

from trainers.grpo.off_policy import MISMATCH_CORRECTIONS, off_policy_sequence_mask

pytestmark = pytest.mark.unit

# two completions of 3 and 2 tokens (the second's last position is padding)
TRAINER = torch.tensor([[-1.0, -0.5, -2.0], [-0.1, -0.7, -9.0]], dtype=torch.float64, requires_grad=True)
SAMPLER = torch.tensor([[-1.2, -0.5, -0.5], [-3.0, -0.4, -1.0]], dtype=torch.float64)
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
CAP = 3.0


def token_ratios() -> list[list[float]]:
    """exp(m_t (log π_old − log π_sampler)) per position: 1 where the mask is 0."""
    return [
        [math.exp(m * (t - s)) for t, s, m in zip(*rows)]
        for rows in zip(TRAINER.tolist(), SAMPLER.tolist(), MASK.tolist())
    ]


def sequence_ratios() -> list[float]:
    """exp(Σ_t m_t (log π_old − log π_sampler)) per completion."""
    return [
        math.exp(sum(m * (t - s) for t, s, m in zip(*rows)))
        for rows in zip(TRAINER.tolist(), SAMPLER.tolist(), MASK.tolist())
    ]


LOW = 0.5  # C_min: e^-1.5 and e^-1.3 lie below it


@pytest.mark.parametrize(
    ("mode", "low", "expected"),
    [
        ("token_truncate", None, [[min(r, CAP) for r in row] for row in token_ratios()]),
        ("token_mask", None, [[r if r <= CAP else 0.0 for r in row] for row in token_ratios()]),
        ("sequence_truncate", None, [[min(r, CAP)] for r in sequence_ratios()]),
        ("sequence_mask", None, [[r if r <= CAP else 0.0] for r in sequence_ratios()]),
        ("token_truncate", LOW, [[min(max(r, LOW), CAP) for r in row] for row in token_ratios()]),
        ("token_mask", LOW, [[r if LOW <= r <= CAP else 0.0 for r in row] for row in token_ratios()]),
        ("sequence_truncate", LOW, [[min(max(r, LOW), CAP)] for r in sequence_ratios()]),
        ("sequence_mask", LOW, [[r if LOW <= r <= CAP else 0.0] for r in sequence_ratios()]),
    ],
)
def test_each_mismatch_correction_is_its_formula_without_gradient(mode, low, expected):
    weighted = MISMATCH_CORRECTIONS.lookup(mode).weights(TRAINER, SAMPLER, MASK, CAP, low)
    assert weighted.weights.flatten().tolist() == pytest.approx([w for row in expected for w in row], rel=1e-12)
    assert not weighted.weights.requires_grad


def test_the_constructed_batch_has_ratios_on_both_sides_of_the_cap():
    # per token: e^0.2, 1, e^-1.5 | e^2.9 (over 3), e^-0.3, padding; per completion: e^-1.3, e^2.6 (over 3)
    flat = [r for row in token_ratios() for r in row]
    assert sum(r > CAP for r in flat) == 1 and sequence_ratios()[0] < CAP < sequence_ratios()[1]


def test_the_corrections_metrics_count_tokens_or_completions():
    by_token = MISMATCH_CORRECTIONS.lookup("token_mask").weights(TRAINER, SAMPLER, MASK, CAP).metrics(MASK)
    # the five counted tokens: e^0.2, 1, e^-1.5, dropped (e^2.9 > 3), e^-0.3
    kept = [math.exp(0.2), 1.0, math.exp(-1.5), 0.0, math.exp(-0.3)]
    assert {k: v.item() for k, v in by_token.items()} == pytest.approx(
        {
            "vllm/is_ratio_min": 0.0,
            "vllm/is_ratio_mean": sum(kept) / 5,
            "vllm/is_ratio_max": math.exp(0.2),
            "vllm/is_outside_fraction": 1 / 5,
        }
    )
    by_sequence = MISMATCH_CORRECTIONS.lookup("sequence_truncate").weights(TRAINER, SAMPLER, MASK, 2.0).metrics(MASK)
    assert {k: v.item() for k, v in by_sequence.items()} == pytest.approx(
        {
            "vllm/is_ratio_min": math.exp(-1.3),
            "vllm/is_ratio_mean": (math.exp(-1.3) + 2.0) / 2,
            "vllm/is_ratio_max": 2.0,
            "vllm/is_outside_fraction": 0.5,
        }
    )


def test_the_off_policy_sequence_mask_drops_drifted_completions_with_negative_advantages():
    old = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]])
    logps = torch.tensor([[-1.5, -1.5], [-1.5, -1.5], [-1.1, -1.1], [-3.0, -0.1]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    advantages = torch.tensor([-1.0, 0.0, -1.0, -0.5])
    # mean_t m_t (old − new): 0.5, 0.5, 0.1, 2.0 (its second token is padding)
    drift = [0.5, 0.5, 0.1, 2.0]
    threshold = 0.3
    expected = [[1.0 if a >= 0 or d <= threshold else 0.0] for a, d in zip(advantages.tolist(), drift)]
    assert expected == [[0.0], [1.0], [1.0], [0.0]]
    kept = off_policy_sequence_mask(advantages, logps, old, mask, threshold)
    assert kept.tolist() == expected and not kept.requires_grad
