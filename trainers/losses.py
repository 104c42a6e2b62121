"""Preference losses, registered by name. Each is a pure function of per-pair tensors."""

from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.nn.functional as F


class PreferenceLoss(Protocol):
    def __call__(
        self,
        chosen_logps: torch.Tensor,
        rejected_logps: torch.Tensor,
        ref_chosen_logps: torch.Tensor,
        ref_rejected_logps: torch.Tensor,
        *,
        beta: float,
    ) -> torch.Tensor: ...


PREFERENCE_LOSSES: dict[str, PreferenceLoss] = {}


def register_loss(name: str) -> Callable[[PreferenceLoss], PreferenceLoss]:
    def decorator(fn: PreferenceLoss) -> PreferenceLoss:
        if name in PREFERENCE_LOSSES:
            raise ValueError(f"preference loss {name!r} is already registered")
        PREFERENCE_LOSSES[name] = fn
        return fn

    return decorator


def get_loss(name: str) -> PreferenceLoss:
    if name not in PREFERENCE_LOSSES:
        raise ValueError(f"unknown loss_type {name!r}; registered: {sorted(PREFERENCE_LOSSES)}")
    return PREFERENCE_LOSSES[name]


@register_loss("sigmoid")
def sigmoid_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, *, beta):
    """DPO (Rafailov et al., 2023, arXiv:2305.18290), per pair:

        L = -log σ( β · [ (π_c − ref_c) − (π_r − ref_r) ] )

    where π and ref are summed completion log-probs under the policy and the reference;
    β multiplies the difference of the two log-ratios.
    """
    logits = (chosen_logps - ref_chosen_logps) - (rejected_logps - ref_rejected_logps)
    return -F.logsigmoid(beta * logits)
