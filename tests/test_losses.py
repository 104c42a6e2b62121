"""Every registered loss against its formula, written here independently with ``math`` on floats."""

import math

import pytest
import torch

from trainers.losses import (
    PREFERENCE_LOSSES,
    LossMix,
    LossParams,
    PairLogps,
    PreferenceHyperparameters,
    get_loss,
    resolve_losses,
    sigmoid_loss,
)

# (π_c, π_r, ref_c, ref_r, |y_c|, |y_r|) per pair: policy / reference summed log-probs and lengths.
PAIRS = [
    (-3.0, -5.0, -4.0, -4.5, 2, 3),
    (-1.0, -0.5, -1.5, -1.0, 1, 4),
    (-12.0, -7.0, -10.0, -9.5, 6, 5),
    (-2.0, -9.0, -2.5, -3.0, 3, 7),
]
BETA, EPS, TAU, SHIFT = 0.3, 0.1, 0.05, 0.2


def logsig(x):
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def sig(x):
    return 1 / (1 + math.exp(-x))


def expected(name, pc, pr, rc, rr, lc, lr, b=BETA, e=EPS, tau=TAU, shift=SHIFT):
    d = (pc - rc) - (pr - rr)
    wc, wl = b * (pc - rc), b * (pr - rr)
    if name == "sigmoid":
        return -(1 - e) * logsig(b * d) - e * logsig(-b * d)
    if name == "robust":
        return (-(1 - e) * logsig(b * d) + e * logsig(-b * d)) / (1 - 2 * e)
    if name == "hinge":
        return max(0.0, 1 - b * d)
    if name == "ipo":
        return ((pc - rc) / lc - (pr - rr) / lr - 1 / (2 * b)) ** 2
    if name == "exo_pair":
        p = sig(b * d)
        return p * math.log(p / (1 - e)) + (1 - p) * math.log((1 - p) / e)
    if name == "nca_pair":
        return -logsig(wc) - 0.5 * logsig(-wc) - 0.5 * logsig(-wl)
    if name == "bco_pair":
        return -logsig(wc - shift) - logsig(shift - wl)
    if name == "sppo_hard":
        return (pc - rc - 1 / (2 * b)) ** 2 + (pr - rr + 1 / (2 * b)) ** 2
    if name == "apo_zero":
        return (1 - sig(wc)) + sig(wl)
    if name == "apo_down":
        return sig(wc) + (1 - sig(wc - wl))
    if name == "sigmoid_norm":
        return -logsig(b * ((pc - rc) / lc - (pr - rr) / lr))
    if name == "discopop":
        m = sig(b * d / tau)
        return -logsig(b * d) * (1 - m) + math.exp(-b * d) * m
    if name == "sft":
        return -pc / lc
    raise KeyError(name)


def pair_tensors(rows=PAIRS, dtype=torch.float64) -> PairLogps:
    columns = [torch.tensor(column, dtype=dtype) for column in zip(*rows)]
    return PairLogps(*columns)


ALL_LOSSES = sorted(PREFERENCE_LOSSES)


CHANGED_HYPERPARAMETERS = {"beta": 0.7, "label_smoothing": 0.2, "discopop_tau": 0.5}


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_a_loss_reads_exactly_the_hyperparameters_and_state_it_declares(name):
    """Changing a declared hyperparameter (or the running shift of a stateful loss) changes the
    loss; changing any other leaves it bit-identical: the declarations the config checks and the
    trainer's state handling rely on are true."""
    loss, pairs = get_loss(name), pair_tensors()
    base = LossParams(beta=BETA, label_smoothing=EPS, discopop_tau=TAU, reward_shift=SHIFT)
    assert set(CHANGED_HYPERPARAMETERS) == set(PreferenceHyperparameters.model_fields)
    changes = CHANGED_HYPERPARAMETERS | {"reward_shift": 2 * SHIFT}
    for field, value in changes.items():
        changed = loss(pairs, base.model_copy(update={field: value}))
        reads = field in loss.hyperparameters or (field == "reward_shift" and loss.stateful)
        assert torch.equal(changed, loss(pairs, base)) is not reads, field


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_loss_matches_independent_formula(name):
    params = LossParams(beta=BETA, label_smoothing=EPS, discopop_tau=TAU, reward_shift=SHIFT)
    got = get_loss(name)(pair_tensors(), params)
    assert got.shape == (len(PAIRS),)
    want = [expected(name, *row) for row in PAIRS]
    assert got.tolist() == pytest.approx(want, abs=1e-6)
    # float32, as in training, stays within 1e-6 of the float64 value on these inputs (sppo_hard's
    # squares of ~10 are the largest values; relative fp32 rounding, so compare relatively there)
    got32 = get_loss(name)(pair_tensors(dtype=torch.float32), params)
    assert got32.tolist() == pytest.approx(want, abs=1e-6, rel=1e-6)


def test_sigmoid_without_smoothing_and_beta_scaling_the_difference():
    pairs = pair_tensors()
    got = sigmoid_loss(pairs, LossParams(beta=0.3))
    # pair 0: (−3 − −4) − (−5 − −4.5) = 1.5
    assert got[0].item() == pytest.approx(-math.log(sig(0.3 * 1.5)), abs=1e-12)
    assert sigmoid_loss(pairs, LossParams(beta=0.6))[0].item() == pytest.approx(-math.log(sig(0.6 * 1.5)), abs=1e-12)


def test_exo_pair_uses_a_small_epsilon_when_smoothing_is_zero():
    got = get_loss("exo_pair")(pair_tensors(), LossParams(beta=BETA))
    assert got.tolist() == pytest.approx([expected("exo_pair", *row, e=1e-3) for row in PAIRS], abs=1e-6)


def test_discopop_is_finite_for_very_negative_margins():
    pairs = pair_tensors([(-400.0, 0.0, 0.0, 0.0, 1, 1)], dtype=torch.float32)
    loss = get_loss("discopop")(pairs, LossParams(beta=1.0))
    assert torch.isfinite(loss).all()
    assert loss.item() == pytest.approx(400.0, rel=1e-6)  # −log σ(−400) ≈ 400, modulation ≈ 0


def test_combined_losses_are_weighted_sums_with_components():
    mix = resolve_losses(["sigmoid", "sft"], [1.0, 0.25], PreferenceHyperparameters())
    assert mix == LossMix((get_loss("sigmoid"), get_loss("sft")), (1.0, 0.25))
    assert (mix.names, mix.stateful, mix.hyperparameters) == (("sigmoid", "sft"), False, {"beta", "label_smoothing"})
    assert resolve_losses(["bco_pair"], None, PreferenceHyperparameters()).stateful
    total, components = mix(pair_tensors(), LossParams(beta=BETA))
    want = [expected("sigmoid", *row, e=0.0) + 0.25 * expected("sft", *row) for row in PAIRS]
    assert total.tolist() == pytest.approx(want, abs=1e-6)
    assert components["sft"].tolist() == pytest.approx([expected("sft", *row) for row in PAIRS], abs=1e-6)
    assert resolve_losses("ipo", None, PreferenceHyperparameters()) == LossMix((get_loss("ipo"),), (1.0,))


@pytest.mark.parametrize(
    "loss_type, weights, hyperparameters, message",
    [
        ("nope", None, {}, "unknown loss_type 'nope'"),
        (["sigmoid", "sigmoid"], None, {}, "repeats a loss"),
        ([], None, {}, "non-empty list"),
        (["sigmoid", "sft"], [1.0], {}, "1 weights for 2 losses"),
        (["sigmoid", "sft"], [1.0, -1.0], {}, "non-negative"),
        ("hinge", None, {"label_smoothing": 0.1}, "label_smoothing: 0.1 has no effect on \\['hinge'\\]"),
        (
            "sigmoid",
            None,
            {"discopop_tau": 0.1},
            "discopop_tau: 0.1 has no effect on \\['sigmoid'\\]; it is read by \\['discopop'\\]",
        ),
    ],
)
def test_invalid_loss_configurations_are_errors(loss_type, weights, hyperparameters, message):
    with pytest.raises(ValueError, match=message):
        resolve_losses(loss_type, weights, PreferenceHyperparameters(**hyperparameters))


def test_beta_counts_as_used_by_every_loss_because_it_scales_the_logged_rewards():
    assert resolve_losses("sft", None, PreferenceHyperparameters(beta=0.5)).names == ("sft",)
