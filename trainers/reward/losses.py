"""The reward model's loss, a pure function of the chosen and rejected sequences' rewards."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bradley_terry_losses(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    margin: torch.Tensor | None = None,
    center_rewards_coefficient: float | None = None,
) -> torch.Tensor:
    """The Bradley–Terry reward-model loss per pair (Ouyang et al. 2022, arXiv:2203.02155, eq. 1;
    the margin of Touvron et al. 2023, arXiv:2307.09288, eq. 2; the centring term of Eisenstein et
    al. 2023, arXiv:2312.09244), for rewards ``r_c``, ``r_r`` of the chosen and rejected sequences:

        L = −log σ(r_c − r_r − m) + c (r_c + r_r)²

    ``m`` is the pair's margin (0 without one), ``c`` the centring coefficient (none: 0). The
    centring term's batch mean is TRL's ``center_rewards_coefficient · mean((r_c + r_r)²)``."""
    difference = chosen - rejected
    if margin is not None:
        difference = difference - margin
    losses = -F.logsigmoid(difference)
    if center_rewards_coefficient:
        losses = losses + center_rewards_coefficient * (chosen + rejected) ** 2
    return losses
