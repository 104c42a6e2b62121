"""Trainer callbacks of the preference trainers."""

from __future__ import annotations

import torch
from transformers import TrainerCallback
from transformers.modeling_utils import unwrap_model


@torch.no_grad()
def mix_into_reference(reference: torch.nn.Module, policy: torch.nn.Module, alpha: float) -> None:
    """``ref ← α·θ + (1 − α)·ref`` for every parameter, matched by name."""
    reference_params = dict(unwrap_model(reference).named_parameters())
    policy_params = dict(unwrap_model(policy).named_parameters())
    if reference_params.keys() != policy_params.keys():
        missing = sorted(reference_params.keys() ^ policy_params.keys())[:5]
        raise ValueError(f"reference and policy parameters differ (e.g. {missing}); cannot sync the reference")
    for name, param in policy_params.items():
        target = reference_params[name]
        target.lerp_(param.to(target.dtype), alpha)


class SyncReferenceCallback(TrainerCallback):
    """TR-DPO soft reference update (Gorbatovski et al., 2024, arXiv:2404.09656): after every
    ``sync_steps`` optimizer steps, ``ref ← α·θ + (1 − α)·ref`` on the live reference model."""

    def __init__(self, ref_model: torch.nn.Module, alpha: float, sync_steps: int):
        self.ref_model = ref_model
        self.alpha = alpha
        self.sync_steps = sync_steps

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.sync_steps == 0:
            mix_into_reference(self.ref_model, model, self.alpha)
