"""GRPO's math as pure functions, in three kinds:

* the **per-token objective** (``policy_loss``: the clipped surrogate ``clip``, ``cispo``,
  ``sapo``) of the **importance ratio** (``importance_sampling_level``: per token, or GSPO's
  length-normalised sequence ratio);
* **add-ons** to the per-token loss: the k3 KL (optionally bias-corrected), an entropy bonus, and
  the mask that keeps only the highest-entropy tokens;
* the **aggregation** (``loss_type``) of per-token losses into one scalar.

Shapes: ``[B, T]`` per-token tensors with a 0/1 ``mask`` of the completion tokens that count; a
sequence-level ratio has shape ``[B, 1]`` and broadcasts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Callable, NamedTuple, Protocol, Sequence

from trainers.lazy import LazyModule
from trainers.registry import RegisteredName, Registry

if TYPE_CHECKING:
    import torch
else:  # the registries are read at config validation, which imports no torch
    torch = LazyModule("torch")

ADVANTAGE_EPS = 1e-4


# ---- advantages -------------------------------------------------------------------------------


def nan_std(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Unbiased standard deviation of the non-``NaN`` entries, √(Σ (x − x̄)² / (n − 1)) over the
    ``n`` present values (0 where ``n`` < 2); along ``dim`` with the dimension kept, or over all."""
    if dim is None:
        values, dim = values.flatten(), 0
    centred = values - values.nanmean(dim=dim, keepdim=True)
    present = (~values.isnan()).sum(dim=dim, keepdim=True)
    return (centred.square().nansum(dim=dim, keepdim=True) / (present - 1).clamp(min=1)).sqrt()


# grouped rewards [num_prompts, G] (NaN: unscored) -> the divisor of each centred reward, broadcastable
RewardScale = Callable[["torch.Tensor"], "torch.Tensor"]
REWARD_SCALES: Registry[RewardScale] = Registry("reward scale", "scale_rewards")
REWARD_SCALES.add("group", lambda grouped: nan_std(grouped, dim=1) + ADVANTAGE_EPS)
REWARD_SCALES.add("batch", lambda grouped: nan_std(grouped) + ADVANTAGE_EPS)
REWARD_SCALES.add("none", lambda grouped: torch.ones((), dtype=grouped.dtype))


# grouped rewards [num_prompts, G] (NaN: unscored) -> each reward's baseline, broadcastable
RewardBaseline = Callable[["torch.Tensor"], "torch.Tensor"]
ADVANTAGE_ESTIMATORS: Registry[RewardBaseline] = Registry("advantage estimator", "advantage_estimator")


@ADVANTAGE_ESTIMATORS.register("grpo")
def group_mean_baseline(grouped: torch.Tensor) -> torch.Tensor:
    """GRPO (Shao et al., 2024, arXiv:2402.03300): the mean reward of the group, ``b_i = mean_j r_j``."""
    return grouped.nanmean(dim=1, keepdim=True)


@ADVANTAGE_ESTIMATORS.register("rloo")
def leave_one_out_baseline(grouped: torch.Tensor) -> torch.Tensor:
    """RLOO (Kool et al., 2019, "Buy 4 REINFORCE samples"; Ahmadian et al., 2024, arXiv:2402.14740):
    the mean reward of the *other* completions of the prompt, an unbiased baseline,

        b_i = 1/(k − 1) Σ_{j ≠ i} r_j,   so   A_i = r_i − b_i = k/(k − 1) · (r_i − mean_j r_j)

    over the ``k`` scored completions of the group (``NaN``: unscored); a group with one scored
    completion has no other to compare with: ``b_i = r_i``."""
    present = (~grouped.isnan()).sum(dim=1, keepdim=True)
    others = (grouped.nansum(dim=1, keepdim=True) - grouped) / (present - 1).clamp(min=1)
    return torch.where(present > 1, others, grouped)


def group_advantages(
    rewards: torch.Tensor, num_generations: int, scale: str = "group", estimator: str = "grpo"
) -> torch.Tensor:
    """Advantages of a group estimator, one per completion:

        A_i = (r_i − b_i) / (s + ε),   ε = 1e-4

    ``r`` holds ``num_generations`` consecutive completions per prompt; ``b_i`` is the
    ``estimator``'s baseline (:data:`ADVANTAGE_ESTIMATORS`: the group mean for GRPO, the mean of the
    others for RLOO). ``s`` is the group's standard deviation (``group``) or that of the whole
    generation batch (``batch``); ``none`` divides by 1 (no ε; Dr. GRPO, Liu et al., 2025,
    arXiv:2503.20783; TRL's RLOO). Standard deviations are unbiased (n − 1).

    A completion no reward function scored (``NaN``) is missing, not worth 0: the baselines and
    standard deviations are over the scored completions only, and its own advantage is 0.
    """
    divisor = REWARD_SCALES.lookup(scale)
    baseline = ADVANTAGE_ESTIMATORS.lookup(estimator)
    grouped = rewards.view(-1, num_generations)
    advantages = (grouped - baseline(grouped)) / divisor(grouped)
    return advantages.nan_to_num(nan=0.0).flatten()


def sequence_kl(old_logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The sampled completion's KL estimate to the reference, summed over its tokens (k1; TRL's
    RLOO, verl's ``kl_penalty: kl``): ``Σ_t m_t (log π_old(y_t) − log π_ref(y_t))``, per row."""
    return ((old_logps - ref_logps) * mask).sum(-1)


def normalized_advantages(advantages: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """``(A − mean A) / (std A + 1e-4)`` over the scored completions of the generation batch (TRL's
    ``normalize_advantages``; unbiased std); an unscored completion's advantage stays 0."""
    values = advantages[scored]
    return torch.where(scored, (advantages - values.mean()) / (values.std() + 1e-4), torch.zeros_like(advantages))


def weighted_rewards(scores: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``r_j = Σ_f w_f · s_{f,j}`` over the functions that scored row ``j`` (``NaN`` = ``None`` is
    skipped); ``NaN`` for a row that no function scored."""
    total = torch.nansum(scores * weights.unsqueeze(1), dim=0)
    return total.masked_fill(scores.isnan().all(dim=0), math.nan)


# ---- per-token terms --------------------------------------------------------------------------


def clipped_surrogate(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
    delta: float | None = None,
) -> torch.Tensor:
    """PPO's clipped objective (Schulman et al., 2017) per token, as in GRPO, with DAPO's
    decoupled upper bound (Yu et al., 2025, arXiv:2503.14476):

        ρ_t = exp(log π(o_t) − log π_old(o_t))
        ℓ_t = −min(ρ_t · A,  clip(ρ_t, 1 − ε_low, 1 + ε_high) · A)

    ``A`` is the completion's advantage, shape ``[B]``. On-policy (π_old = π, detached) ρ = 1
    and the gradient is −A ∇log π. ``delta``: two-sided clipping, see :func:`clip_objective`.
    """
    return clipped_ratio_loss(torch.exp(logps - old_logps), advantages, epsilon_low, epsilon_high, delta)


def clipped_ratio_loss(
    ratio: torch.Tensor, advantages: torch.Tensor, epsilon_low: float, epsilon_high: float, delta: float | None
) -> torch.Tensor:
    """``−min(min(ρ, δ) · A, clip(ρ, 1 − ε_low, 1 + ε_high) · A)`` for a ratio ``[B, T]`` or ``[B, 1]``
    (no ``min(ρ, δ)`` when ``delta`` is None)."""
    advantages = advantages.unsqueeze(1)
    clipped = ratio.clamp(1 - epsilon_low, 1 + epsilon_high)
    if delta is not None:
        ratio = ratio.clamp(max=delta)
    return -torch.min(ratio * advantages, clipped * advantages)


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
    return ratio_clip_fractions(torch.exp(logps - old_logps), advantages, mask, epsilon_low, epsilon_high)


def ratio_clip_fractions(
    ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, epsilon_low: float, epsilon_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`clip_fractions` of a token ``[B, T]`` or sequence ``[B, 1]`` ratio; a sequence's
    clip counts for each of its tokens."""
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


def bias_corrected_k3_kl(logps: torch.Tensor, old_logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """k3 weighted by the token's importance ratio π/π_old, *with* its gradient (DeepSeek-V3.2,
    arXiv:2512.02556, its unbiased KL estimate; TRL's ``use_bias_correction_kl``):

        kl_t = exp(log π − log π_old) · k3_t

    The value is an unbiased estimate of KL(π ‖ π_ref) when the tokens were sampled from π_old.
    The gradient is what changes, even on-policy (ρ = 1): plain k3's ∇ is
    (1 − π_ref/π) ∇log π, whose expectation under π is ∇KL(π_ref ‖ π) (the *forward* KL);
    the corrected one's is (log π − log π_ref) ∇log π, whose expectation is ∇KL(π ‖ π_ref), the
    reverse KL that the GRPO objective writes down. The ratio is always the per-token one.
    """
    return torch.exp(logps - old_logps) * k3_kl(logps, ref_logps)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of each position's next-token distribution, ``H_t = −Σ_v p_v log p_v``, in float32
    (float64 for float64 logits), differentiable. ``[B, T, V] → [B, T]``."""
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
    return -(logp.exp() * logp).sum(-1)


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """Keep the top-``quantile`` fraction of counted tokens by entropy (Wang et al., 2025, "Beyond
    the 80/20 Rule", arXiv:2506.01939):

        keep_t = m_t · 1[H_t ≥ τ],   τ = the (1 − ρ) quantile of {H_t : m_t = 1}

    (linear interpolation between order statistics; ρ = ``quantile``, 0.2 in the paper). The
    result multiplies the policy term only; the aggregation's normaliser still counts every
    token, as in the paper. Float 0/1 in ``mask``'s dtype; all zeros when no token counts.
    """
    counted = entropy[mask.bool()]
    if counted.numel() == 0:
        return torch.zeros_like(mask)
    threshold = torch.quantile(counted.to(torch.promote_types(counted.dtype, torch.float32)), 1.0 - quantile)
    return (entropy >= threshold).to(mask.dtype) * mask


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


# ---- importance ratios: importance_sampling_level ---------------------------------------------


@dataclass(frozen=True)
class ImportanceLevel:
    """How log π − log π_old becomes the importance ratio's logarithm, and which config fields
    hold the clip range ``(ε_low, ε_high)`` at this level."""

    name: str
    log_ratio: Callable[["torch.Tensor", "torch.Tensor", "torch.Tensor"], "torch.Tensor"]
    clip_range: tuple[str, str]


def token_log_ratio(logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """PPO/GRPO's per-token ratio: ``log ρ_t = log π(o_t) − log π_old(o_t)``, ``[B, T]``."""
    return logps - old_logps


def sequence_log_ratio(logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's sequence ratio (Zheng et al., 2025, arXiv:2507.18071), length-normalised:

        s_i = (π(o_i) / π_old(o_i))^(1/|o_i|) = exp( (1/|o_i|) Σ_t m_t (log π(o_t) − log π_old(o_t)) )

    ``[B, 1]`` (log s_i; 0 for a completion with no counted token). Every token of ``o_i`` shares
    it, so the clip keeps or drops whole completions, and the gradient of ``s_i · A_i`` gives every
    token the same weight s_i·A_i/|o_i| instead of its own ρ_t.
    """
    return ((logps - old_logps) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)


IMPORTANCE_LEVELS: Registry[ImportanceLevel] = Registry("importance sampling level", "importance_sampling_level")
IMPORTANCE_LEVELS.add("token", ImportanceLevel("token", token_log_ratio, ("epsilon", "epsilon_high")))
IMPORTANCE_LEVELS.add(
    "sequence", ImportanceLevel("sequence", sequence_log_ratio, ("sequence_epsilon", "sequence_epsilon_high"))
)
ImportanceLevelName = Annotated[str, RegisteredName(IMPORTANCE_LEVELS)]


# ---- per-token objectives: policy_loss -------------------------------------------------------


class ObjectiveParams(NamedTuple):
    """What an objective receives: the clip range of the importance level in use, and the
    objectives' own hyperparameters (fields of the GRPO section, read as the objective declares)."""

    epsilon_low: float
    epsilon_high: float
    delta: float | None = None
    cispo_max_ratio: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05


# (log ρ [B, T] or [B, 1], log π [B, T], advantages [B], params) -> per-token loss, broadcastable to [B, T]
ObjectiveFunction = Callable[["torch.Tensor", "torch.Tensor", "torch.Tensor", ObjectiveParams], "torch.Tensor"]


# (ρ [B, T] or [B, 1], detached; advantages [B]; mask [B, T]; params) -> named scalars for the logs
ObjectiveMetrics = Callable[["torch.Tensor", "torch.Tensor", "torch.Tensor", ObjectiveParams], dict]


@dataclass(frozen=True)
class PolicyObjective:
    """A registered objective: its function, the section fields it reads (``clip_range``: also the
    importance level's ``ε`` fields), those it cannot do without, and the metrics that describe
    it (computed without gradient at every step; ``None``: none)."""

    name: str
    function: ObjectiveFunction
    hyperparameters: frozenset[str]
    required: frozenset[str]
    clip_range: bool
    metrics: ObjectiveMetrics | None = None

    def __call__(self, log_ratio, logps, advantages, params: ObjectiveParams) -> torch.Tensor:
        return self.function(log_ratio, logps, advantages, params)


POLICY_OBJECTIVES: Registry[PolicyObjective] = Registry("policy objective", "policy_loss")
get_policy_objective = POLICY_OBJECTIVES.lookup
PolicyObjectiveName = Annotated[str, RegisteredName(POLICY_OBJECTIVES)]


def register_policy_objective(
    name: str,
    *,
    hyperparameters: Sequence[str] = (),
    required: Sequence[str] = (),
    clip_range: bool = False,
    metrics: ObjectiveMetrics | None = None,
) -> Callable[[ObjectiveFunction], ObjectiveFunction]:
    def decorator(function: ObjectiveFunction) -> ObjectiveFunction:
        spec = PolicyObjective(name, function, frozenset(hyperparameters), frozenset(required), clip_range, metrics)
        POLICY_OBJECTIVES.add(name, spec)
        return function

    return decorator


def clip_metrics(ratio, advantages, mask, params) -> dict:
    """``clip_ratio/low_mean``, ``clip_ratio/high_mean``: :func:`ratio_clip_fractions`."""
    low, high = ratio_clip_fractions(ratio, advantages, mask, params.epsilon_low, params.epsilon_high)
    return {"clip_ratio/low_mean": low, "clip_ratio/high_mean": high}


def cispo_metrics(ratio, advantages, mask, params) -> dict:
    """``cispo/capped_fraction``: counted tokens whose weight the cap ρ_max binds (ρ > ρ_max)."""
    capped = (ratio > params.cispo_max_ratio).float()
    return {"cispo/capped_fraction": masked_mean(capped.expand_as(mask), mask)}


@register_policy_objective("clip", hyperparameters=("delta",), clip_range=True, metrics=clip_metrics)
def clip_objective(log_ratio, logps, advantages, params):
    """The clipped surrogate of PPO/GRPO (:func:`clipped_surrogate`) on the level's ratio ρ, with
    optional two-sided clipping (INTELLECT-2, arXiv:2505.07291, ``delta`` = δ > 1 + ε_high):

        ℓ_t = −min(min(ρ, δ) · A,  clip(ρ, 1 − ε_low, 1 + ε_high) · A)

    δ only changes A < 0: there the unclipped term, unbounded in ρ, is capped at δ·A. With
    ``importance_sampling_level: sequence`` ρ = s_i and this is GSPO's objective.
    """
    return clipped_ratio_loss(torch.exp(log_ratio), advantages, params.epsilon_low, params.epsilon_high, params.delta)


@register_policy_objective(
    "cispo", hyperparameters=("cispo_max_ratio",), required=("cispo_max_ratio",), metrics=cispo_metrics
)
def cispo_objective(log_ratio, logps, advantages, params):
    """CISPO (MiniMax-M1 report, arXiv:2506.13585): clip the importance *weight*, stop its
    gradient, and keep every token's policy gradient:

        ℓ_t = −sg(min(ρ_t, ρ_max)) · A · log π(o_t),   ∇ℓ_t = −min(ρ_t, ρ_max) · A · ∇log π(o_t)

    ``ρ_max`` = ``cispo_max_ratio`` (1 + ε_high^IS in the report, ε_max in ScaleRL,
    arXiv:2510.13786); the report's lower bound is left off (it sets ε_low^IS large). The
    value of ℓ is only a vehicle for the gradient; compare losses across objectives by reward.
    """
    weight = torch.exp(log_ratio).clamp(max=params.cispo_max_ratio).detach()
    return -weight * advantages.unsqueeze(1) * logps


@register_policy_objective("sapo", hyperparameters=("sapo_temperature_pos", "sapo_temperature_neg"))
def sapo_objective(log_ratio, logps, advantages, params):
    """SAPO (Soft Adaptive Policy Optimization, Qwen team, 2025, arXiv:2511.20347): a smooth,
    temperature-controlled gate instead of the hard clip,

        ℓ_t = −(4/τ) · σ(τ (ρ_t − 1)) · A,   τ = τ_pos if A > 0 else τ_neg

    Its gradient −4 σ(1 − σ) ρ A ∇log π equals −A ∇log π on-policy (ρ = 1) and fades smoothly as
    ρ leaves 1 (faster for the larger τ_neg, since negative updates are the less stable ones).
    """
    advantages = advantages.unsqueeze(1)
    temperature = torch.where(
        advantages > 0, advantages.new_tensor(params.sapo_temperature_pos), params.sapo_temperature_neg
    )
    return -(4.0 / temperature) * torch.sigmoid(temperature * (torch.exp(log_ratio) - 1)) * advantages


# ---- aggregations: loss_type -----------------------------------------------------------------


class LossAggregation(Protocol):
    def __call__(
        self, per_token_loss: torch.Tensor, mask: torch.Tensor, *, max_completion_length: int, tokens_per_step: float
    ) -> torch.Tensor: ...


GRPO_LOSSES: Registry[LossAggregation] = Registry("GRPO loss", "loss_type")
register_grpo_loss = GRPO_LOSSES.register
get_grpo_loss = GRPO_LOSSES.lookup
GRPOLossName = Annotated[str, RegisteredName(GRPO_LOSSES)]
RewardScaleName = Annotated[str, RegisteredName(REWARD_SCALES)]
AdvantageEstimatorName = Annotated[str, RegisteredName(ADVANTAGE_ESTIMATORS)]


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


@register_grpo_loss("luspo")
def luspo_loss(per_token_loss, mask, *, max_completion_length, tokens_per_step):
    """LUSPO's length-weighted sequence loss (Length-Unbiased Sequence Policy Optimization,
    arXiv:2602.05261, as TRL implements it): a constant normaliser, the number of completions,

        L = 1/B Σ_i |o_i| ℓ_i = Σ_i Σ_t ℓ_{i,t} / B

    where ℓ_i is the loss every token of ``o_i`` shares at ``importance_sampling_level: sequence``
    (GSPO's ratio), so a completion weighs by its length; Dr. GRPO's sum with B in place of
    B · L_max. Meant for the sequence level; at token level it is still Σ ℓ / B.
    """
    return (per_token_loss * mask).sum() / per_token_loss.shape[0]
