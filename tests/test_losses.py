import math

import pytest
import torch

from trainers.losses import PREFERENCE_LOSSES, get_loss, sigmoid_loss


def test_sigmoid_loss_matches_hand_computation_beta_scales_difference():
    pi_c, pi_r = torch.tensor([-3.0, -1.0]), torch.tensor([-5.0, -0.5])
    ref_c, ref_r = torch.tensor([-4.0, -1.5]), torch.tensor([-4.5, -1.0])
    beta = 0.3
    # pair 0: (−3 − −4) − (−5 − −4.5) = 1 − (−0.5) = 1.5 ; pair 1: (0.5) − (0.5) = 0
    expected = [-math.log(1 / (1 + math.exp(-beta * 1.5))), math.log(2.0)]
    losses = sigmoid_loss(pi_c, pi_r, ref_c, ref_r, beta=beta)
    assert losses.tolist() == pytest.approx(expected, abs=1e-6)
    # beta multiplies the difference, not each log-ratio's sigmoid: doubling beta changes pair 0 only as sigmoid(2·β·1.5)
    assert sigmoid_loss(pi_c, pi_r, ref_c, ref_r, beta=2 * beta)[0].item() == pytest.approx(
        -math.log(1 / (1 + math.exp(-2 * beta * 1.5))), abs=1e-6
    )


def test_registry_rejects_unknown_names():
    assert PREFERENCE_LOSSES["sigmoid"] is sigmoid_loss
    with pytest.raises(ValueError, match="unknown loss_type 'nope'"):
        get_loss("nope")
