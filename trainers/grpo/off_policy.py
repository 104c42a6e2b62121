"""Off-policy corrections of GRPO's loss, for completions the trainer's policy did not sample itself.

- **The sampler–trainer mismatch** (``vllm_importance_sampling_mode``, ``vllm_importance_sampling_cap``):
  an inference engine samples with kernels of its own, so its distribution π_sampler differs from
  π_old, the same weights as the trainer computes them. Weighting the loss by π_old / π_sampler,
  bounded by a cap C, makes the gradient the trainer's policy's; the ratio is per token or per
  completion, bounded by truncating it to [C_min, C] (TIS) or by dropping what lies outside (MIS). The
  modes are TRL's; its ``vllm_importance_sampling_clip_max`` is ``vllm_importance_sampling_cap`` here.
- **The off-policy sequence mask** (``off_policy_mask_threshold``): a completion with a negative
  advantage that the current policy has drifted away from is left out of the loss.

Every weight and mask is without gradient; positions outside ``mask`` count for nothing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Callable

from trainers.lazy import LazyModule
from trainers.registry import RegisteredName, Registry

if TYPE_CHECKING:
    import torch
else:  # the registry is read at config validation, which imports no torch
    torch = LazyModule("torch")


def token_mismatch_log_ratio(
    trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """``log r_t = m_t (log π_old(y_t) − log π_sampler(y_t))``, ``[B, T]`` (0 outside the mask)."""
    return (trainer_logps - sampler_logps) * mask


def sequence_mismatch_log_ratio(
    trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """``log r_i = Σ_t m_t (log π_old(y_t) − log π_sampler(y_t))``: the log of the whole completion's
    likelihood ratio π_old(y_i) / π_sampler(y_i), ``[B, 1]``; not length-normalised, unlike GSPO's ratio."""
    return token_mismatch_log_ratio(trainer_logps, sampler_logps, mask).sum(-1, keepdim=True)


def truncated(ratio: torch.Tensor, low: float | None, cap: float) -> torch.Tensor:
    """Truncated importance sampling (TIS; Yao et al., 2025, "Your Efficient RL Framework Secretly
    Brings You Off-Policy RL Training"): ``w = min(max(r, C_min), C)`` (no lower bound without
    ``C_min``). Bounds the variance, keeps every sample."""
    return ratio.clamp(min=low, max=cap)


def masked(ratio: torch.Tensor, low: float | None, cap: float) -> torch.Tensor:
    """Masked importance sampling (MIS; Liu et al., 2025, "When Speed Kills Stability: Demystifying
    RL Collapse from the Training-Inference Mismatch"): ``w = r · 1[C_min ≤ r ≤ C]``. A sample whose
    ratio lies outside is dropped instead of down-weighted: it is too far off the trainer's policy to learn from."""
    return ratio.masked_fill(outside(ratio, low, cap), 0.0)


def outside(ratio: torch.Tensor, low: float | None, cap: float) -> torch.Tensor:
    """Where ``ratio`` lies outside ``[C_min, C]``: truncated or dropped."""
    return (ratio > cap) | (ratio < low if low is not None else torch.zeros_like(ratio, dtype=torch.bool))


@dataclass(frozen=True)
class MismatchCorrection:
    """One ``vllm_importance_sampling_mode``: where the ratio is taken (per token or per completion)
    and how the cap bounds it."""

    name: str
    log_ratio: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    bound: Callable[[torch.Tensor, float | None, float], torch.Tensor]

    @property
    def per_sequence(self) -> bool:
        return self.log_ratio is sequence_mismatch_log_ratio

    def weights(
        self,
        trainer_logps: torch.Tensor,
        sampler_logps: torch.Tensor,
        mask: torch.Tensor,
        cap: float,
        low: float | None = None,
    ) -> MismatchWeights:
        """The loss weights of the engine's samples, ``[B, T]`` or ``[B, 1]``, without gradient: the
        ratio bounded to ``[low, cap]``."""
        with torch.no_grad():
            ratio = torch.exp(self.log_ratio(trainer_logps, sampler_logps, mask))
            return MismatchWeights(self.bound(ratio, low, cap), outside(ratio, low, cap), self.per_sequence)


@dataclass(frozen=True)
class MismatchWeights:
    """The bounded weights, where the raw ratio lay outside the bounds, and whether they are per completion."""

    weights: torch.Tensor
    outside: torch.Tensor
    per_sequence: bool

    def metrics(self, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """The weights' min, mean and max, and the fraction outside the bounds (truncated or dropped),
        over the completions (per completion) or the counted tokens (per token)."""
        counted = torch.ones_like(self.weights, dtype=torch.bool) if self.per_sequence else mask.bool()
        values, out = self.weights[counted], self.outside[counted]
        if values.numel() == 0:
            return {}
        return {
            "vllm/is_ratio_min": values.min(),
            "vllm/is_ratio_mean": values.mean(),
            "vllm/is_ratio_max": values.max(),
            "vllm/is_outside_fraction": out.to(values.dtype).mean(),
        }


MISMATCH_CORRECTIONS: Registry[MismatchCorrection] = Registry(
    "importance sampling mode", "vllm_importance_sampling_mode"
)
for level, log_ratio in (("token", token_mismatch_log_ratio), ("sequence", sequence_mismatch_log_ratio)):
    for kind, bound in (("truncate", truncated), ("mask", masked)):
        MISMATCH_CORRECTIONS.add(f"{level}_{kind}", MismatchCorrection(f"{level}_{kind}", log_ratio, bound))
MismatchCorrectionName = Annotated[str, RegisteredName(MISMATCH_CORRECTIONS)]


def off_policy_sequence_mask(
    advantages: torch.Tensor, logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor, threshold: float
) -> torch.Tensor:
    """The off-policy sequence mask (DeepSeek-V3.2, arXiv:2512.02556; TRL's ``off_policy_mask_threshold``):

        M_i = 0  if  A_i < 0  and  (1/|y_i|) Σ_t m_t (log π_old(y_t) − log π(y_t)) > δ,   else 1

    ``[B, 1]``, without gradient. The average is a per-token estimate of KL(π_old ‖ π) over the
    completion: a completion the policy has moved away from since it was sampled, that the loss
    would push further away (a negative advantage), teaches mostly noise; one with a non-negative
    advantage is always kept."""
    with torch.no_grad():
        drift = ((old_logps - logps) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
        return ((advantages.reshape(-1, 1) >= 0) | (drift <= threshold)).to(mask.dtype)
