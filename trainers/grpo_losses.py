"""GRPO's math as pure functions: advantages, the clipped surrogate, the k3 KL and the
registered aggregations (``loss_type``) of per-token losses into one scalar.

Shapes: ``[B, T]`` per-token tensors with a 0/1 ``mask`` of the completion tokens that count.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

from trainers.lazy import LazyModule
from trainers.registry import Registry

if TYPE_CHECKING:
    import torch
else:  # the registries are read at config validation, which imports no torch
    torch = LazyModule("torch")

ADVANTAGE_EPS = 1e-4


# ---- advantages -------------------------------------------------------------------------------

# grouped rewards [num_prompts, G] -> the divisor of each centred reward, broadcastable
RewardScale = Callable[["torch.Tensor"], "torch.Tensor"]
REWARD_SCALES: Registry[RewardScale] = Registry("reward scale", "scale_rewards")
REWARD_SCALES.add("group", lambda grouped: grouped.std(dim=1, keepdim=True) + ADVANTAGE_EPS)
REWARD_SCALES.add("batch", lambda grouped: grouped.std() + ADVANTAGE_EPS)
REWARD_SCALES.add("none", lambda grouped: torch.ones((), dtype=grouped.dtype))


def group_advantages(rewards: torch.Tensor, num_generations: int, scale: str = "group") -> torch.Tensor:
    """GRPO advantages (Shao et al., 2024, arXiv:2402.03300), one per completion:

        A_i = (r_i − mean(r_group)) / (s + ε),   ε = 1e-4

    ``r`` holds ``num_generations`` consecutive completions per prompt. ``s`` is the group's
    standard deviation (``group``) or that of the whole generation batch (``batch``); ``none``
    divides by 1 (no ε; Dr. GRPO, Liu et al., 2025, arXiv:2503.20783). Standard deviations are
    unbiased (n − 1).
    """
    divisor = REWARD_SCALES.lookup(scale)
    grouped = rewards.view(-1, num_generations)
    return ((grouped - grouped.mean(dim=1, keepdim=True)) / divisor(grouped)).flatten()


def weighted_rewards(scores: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``r_j = Σ_f w_f · s_{f,j}`` over the functions that scored row ``j`` (``NaN`` = ``None`` is
    skipped; a row no function scored gets 0)."""
    return torch.nansum(scores * weights.unsqueeze(1), dim=0)


# ---- per-token terms --------------------------------------------------------------------------


def clipped_surrogate(
    logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, epsilon_low: float, epsilon_high: float
) -> torch.Tensor:
    """PPO's clipped objective (Schulman et al., 2017) per token, as in GRPO, with DAPO's
    decoupled upper bound (Yu et al., 2025, arXiv:2503.14476):

        ρ_t = exp(log π(o_t) − log π_old(o_t))
        ℓ_t = −min(ρ_t · A,  clip(ρ_t, 1 − ε_low, 1 + ε_high) · A)

    ``A`` is the completion's advantage, shape ``[B]``. On-policy (π_old = π, detached) ρ = 1
    and the gradient is −A ∇log π.
    """
    ratio = torch.exp(logps - old_logps)
    advantages = advantages.unsqueeze(1)
    return -torch.min(ratio * advantages, ratio.clamp(1 - epsilon_low, 1 + epsilon_high) * advantages)


def clip_fractions(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fractions of counted tokens whose gradient the clip removes: ρ < 1 − ε_low with A < 0
    (low) and ρ > 1 + ε_high with A > 0 (high)."""
    ratio = torch.exp(logps - old_logps)
    advantages = advantages.unsqueeze(1)
    low = ((ratio < 1 - epsilon_low) & (advantages < 0)).float()
    high = ((ratio > 1 + epsilon_high) & (advantages > 0)).float()
    return masked_mean(low, mask), masked_mean(high, mask)


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(π ‖ π_ref) per token (unbiased, always ≥ 0):

    k3_t = exp(log π_ref − log π) − (log π_ref − log π) − 1
    """
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


# ---- aggregations: loss_type -----------------------------------------------------------------


class LossAggregation(Protocol):
    def __call__(
        self, per_token_loss: torch.Tensor, mask: torch.Tensor, *, max_completion_length: int, tokens_per_step: float
    ) -> torch.Tensor: ...


GRPO_LOSSES: Registry[LossAggregation] = Registry("GRPO loss", "loss_type")
register_grpo_loss = GRPO_LOSSES.register
get_grpo_loss = GRPO_LOSSES.lookup
GRPOLossName = GRPO_LOSSES.name_type()
RewardScaleName = REWARD_SCALES.name_type()


@register_grpo_loss("grpo")
def grpo_loss(per_token_loss, mask, *, max_completion_length, tokens_per_step):
    """GRPO (Shao et al., 2024): mean over completions of each completion's token mean,

        L = 1/B Σ_i (1/|o_i|) Σ_t ℓ_{i,t}

    (a completion with no counted tokens contributes 0). Long completions weigh less per token.
    """
    per_sequence = (per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    return per_sequence.mean()


@register_grpo_loss("bnpo")
def bnpo_loss(per_token_loss, mask, *, max_completion_length, tokens_per_step):
    """Batch-normalised: every counted token of the micro-batch weighs the same,

    L = Σ_i Σ_t ℓ_{i,t} / Σ_i |o_i|
    """
    return masked_mean(per_token_loss, mask)


@register_grpo_loss("dr_grpo")
def dr_grpo_loss(per_token_loss, mask, *, max_completion_length, tokens_per_step):
    """Dr. GRPO (Liu et al., 2025, arXiv:2503.20783): a constant normaliser, free of length bias,

    L = Σ_i Σ_t ℓ_{i,t} / (B · L_max),   L_max = max_completion_length
    """
    return (per_token_loss * mask).sum() / (per_token_loss.shape[0] * max_completion_length)


@register_grpo_loss("dapo")
def dapo_loss(per_token_loss, mask, *, max_completion_length, tokens_per_step):
    """DAPO's token-level loss (Yu et al., 2025, arXiv:2503.14476), normalised by the counted
    tokens ``N`` of the *whole generation batch* (all processes), not of the micro-batch:

        L_micro = Σ_{i,t ∈ micro-batch} ℓ_{i,t} / (N / S),   tokens_per_step = N / S

    ``S`` = ``steps_per_generation`` × processes micro-steps consume the batch. The Trainer
    divides each micro-step by the accumulation steps ``A`` (and DDP averages processes), so the
    batch contributes (S / A) · Σ ℓ / N in all: with ``steps_per_generation`` = A one optimizer
    step takes exactly the big-batch loss Σ ℓ / N; with ``steps_per_generation`` = k·A its k
    optimizer steps take parts whose mean is that loss; with A = k·``steps_per_generation`` an
    optimizer step takes the mean of k big-batch losses.
    """
    return (per_token_loss * mask).sum() / max(float(tokens_per_step), 1.0)
