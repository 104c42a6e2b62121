"""Every registered loss against its formula, written here independently with ``math`` on floats."""

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from trainers.dpo.losses import (
    PREFERENCE_LOSSES,
    LossMix,
    LossParams,
    PairLogps,
    PreferenceHyperparameters,
    get_loss,
    resolve_losses,
    sigmoid_loss,
)

pytestmark = pytest.mark.unit

# (π_c, π_r, ref_c, ref_r, |y_c|, |y_r|) per pair: policy / reference summed log-probs and lengths.
PAIRS = [
    (-3.0, -5.0, -4.0, -4.5, 2, 3),
    (-1.0, -0.5, -1.5, -1.0, 1, 4),
    (-12.0, -7.0, -10.0, -9.5, 6, 5),
    (-2.0, -9.0, -2.7, -3.0, 3, 7),
]
BETA, EPS, TAU, SHIFT = 0.3, 0.1, 0.05, 0.2
# f-DPO's α-divergence (so that f_alpha is read), SimPO's γ, CPO's α, ORPO's λ
F_TYPE, F_ALPHA, GAMMA, CPO_ALPHA, LAMBDA = "alpha_divergence", 0.7, 0.4, 0.6, 0.2
BASE = dict(
    beta=BETA,
    label_smoothing=EPS,
    discopop_tau=TAU,
    reward_shift=SHIFT,
    f_divergence_type=F_TYPE,
    f_alpha=F_ALPHA,
    simpo_gamma=GAMMA,
    cpo_alpha=CPO_ALPHA,
    orpo_lambda=LAMBDA,
)


def logsig(x):
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def sig(x):
    return 1 / (1 + math.exp(-x))


def smoothed(z, e):
    return -(1 - e) * logsig(z) - e * logsig(-z)


def f_prime(kind, u, alpha=F_ALPHA):
    """f'(u) of f-DPO's divergences, on the ratio u = π/ref itself."""
    if kind == "reverse_kl":
        return math.log(u) + 1
    if kind == "forward_kl":
        return 1 - 1 / u
    if kind == "js_divergence":
        return math.log(2 * u / (1 + u))
    if kind == "alpha_divergence":
        return (1 - u ** (-alpha)) / alpha
    raise KeyError(kind)


def log_odds(avg_logp):
    p = math.exp(avg_logp)
    return math.log(p / (1 - p))


def expected(name, pc, pr, rc, rr, lc, lr, b=BETA, e=EPS, tau=TAU, shift=SHIFT, kind=F_TYPE, alpha=F_ALPHA):
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
    if name == "f_divergence":
        uc, ur = math.exp(pc - rc), math.exp(pr - rr)
        return smoothed(b * (f_prime(kind, uc, alpha) - f_prime(kind, ur, alpha)), e)
    if name == "simpo":
        return smoothed(b * (pc / lc - pr / lr) - GAMMA, e)
    if name == "cpo":
        return smoothed(b * (pc - pr), e) - CPO_ALPHA * pc / lc
    if name == "orpo":
        return -pc / lc - LAMBDA * logsig(log_odds(pc / lc) - log_odds(pr / lr))
    raise KeyError(name)


def expected_batch(name, rows, **settings):
    """Per-pair losses of a batch; AOT sorts across the batch, every other loss is per pair."""
    if name in ("aot", "aot_pair"):
        if name == "aot_pair":  # sorted chosen log-ratios against sorted rejected log-ratios
            first, second = sorted(pc - rc for pc, _, rc, *_ in rows), sorted(pr - rr for _, pr, _, rr, *_ in rows)
        else:  # sorted policy chosen-minus-rejected against sorted reference chosen-minus-rejected
            first, second = sorted(pc - pr for pc, pr, *_ in rows), sorted(rc - rr for _, _, rc, rr, *_ in rows)
        b, e = settings.get("b", BETA), settings.get("e", EPS)
        return [smoothed(b * (u - v), e) for u, v in zip(first, second)]
    return [expected(name, *row, **settings) for row in rows]


def pair_tensors(rows=PAIRS, dtype=torch.float64) -> PairLogps:
    columns = [torch.tensor(column, dtype=dtype) for column in zip(*rows)]
    return PairLogps(*columns)


ALL_LOSSES = sorted(PREFERENCE_LOSSES)


CHANGED_HYPERPARAMETERS = {
    "beta": 0.7,
    "label_smoothing": 0.2,
    "discopop_tau": 0.5,
    "f_divergence_type": "js_divergence",
    "f_alpha": 0.3,
    "simpo_gamma": 1.0,
    "cpo_alpha": 0.1,
    "orpo_lambda": 0.5,
}


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_a_loss_reads_exactly_the_hyperparameters_and_state_it_declares(name):
    """Changing a declared hyperparameter (or the running shift of a stateful loss) changes the
    loss; changing any other leaves it bit-identical: the declarations the config checks and the
    trainer's state handling rely on are true."""
    loss, pairs = get_loss(name), pair_tensors()
    base = LossParams(**BASE)
    assert set(CHANGED_HYPERPARAMETERS) == set(PreferenceHyperparameters.model_fields)
    changes = CHANGED_HYPERPARAMETERS | {"reward_shift": 2 * SHIFT}
    for field, value in changes.items():
        changed = loss(pairs, base.model_copy(update={field: value}))
        reads = field in loss.hyperparameters or (field == "reward_shift" and loss.stateful)
        assert torch.equal(changed, loss(pairs, base)) is not reads, field


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_a_loss_reads_the_reference_exactly_when_it_declares_it_needs_one(name):
    """A reference-free loss (``needs_reference=False``) is bit-identical under any reference
    log-probs, so the trainer may skip them; every other loss changes with them."""
    loss, pairs, params = get_loss(name), pair_tensors(), LossParams(**BASE)
    shifted = dataclasses.replace(pairs, ref_chosen=pairs.ref_chosen - 0.7, ref_rejected=pairs.ref_rejected + 0.4)
    assert torch.equal(loss(shifted, params), loss(pairs, params)) is not loss.needs_reference


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_a_losss_term_i_is_pair_is_exactly_when_it_declares_it(name):
    """WPO multiplies term i by pair i's weight, so only a per-pair loss may be weighted (the config
    refuses use_weighting with the others: the loss would change with the order of the pairs). AOT
    sorts: its terms ignore the order; every loss's mean is the same in any order."""
    loss, params = get_loss(name), LossParams(**BASE)
    order = list(reversed(range(len(PAIRS))))
    given, reordered = loss(pair_tensors(), params), loss(pair_tensors([PAIRS[i] for i in order]), params)
    assert torch.allclose(reordered, given[order], atol=1e-12) is loss.per_pair
    assert reordered.mean().item() == pytest.approx(given.mean().item(), abs=1e-12)


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_loss_matches_independent_formula(name):
    params = LossParams(**BASE)
    got = get_loss(name)(pair_tensors(), params)
    assert got.shape == (len(PAIRS),)
    want = expected_batch(name, PAIRS)
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


# The objectives of issue 17, with each f-divergence separately: (loss_type, hyperparameter updates)
NEW_OBJECTIVES = {
    "aot": ("aot", {}),
    "aot_pair": ("aot_pair", {}),
    "f_divergence-reverse_kl": ("f_divergence", {"f_divergence_type": "reverse_kl"}),
    "f_divergence-forward_kl": ("f_divergence", {"f_divergence_type": "forward_kl"}),
    "f_divergence-js_divergence": ("f_divergence", {"f_divergence_type": "js_divergence"}),
    "f_divergence-alpha_divergence": ("f_divergence", {"f_divergence_type": "alpha_divergence"}),
    "simpo": ("simpo", {}),
    "cpo": ("cpo", {}),
    "orpo": ("orpo", {}),
}


@pytest.mark.parametrize("case", sorted(NEW_OBJECTIVES))
def test_new_objective_value_and_gradient_match_the_independent_formula_in_float64(case):
    """Value within 1e-6, and the gradient of the summed batch loss with respect to every policy
    log-prob within 1e-6 of central finite differences of the independent ``math`` formula."""
    name, update = NEW_OBJECTIVES[case]
    params = LossParams(**BASE).model_copy(update=update)
    kind = params.f_divergence_type

    def want(rows):
        return expected_batch(name, rows, kind=kind)

    pairs = pair_tensors()
    chosen, rejected = pairs.chosen.clone().requires_grad_(), pairs.rejected.clone().requires_grad_()
    got = get_loss(name)(dataclasses.replace(pairs, chosen=chosen, rejected=rejected), params)
    assert got.tolist() == pytest.approx(want(PAIRS), abs=1e-6)
    got.sum().backward()

    h = 1e-6
    for column, autograd in ((0, chosen.grad), (1, rejected.grad)):
        for i in range(len(PAIRS)):
            up, down = [list(row) for row in PAIRS], [list(row) for row in PAIRS]
            up[i][column] += h
            down[i][column] -= h
            numeric = (sum(want(up)) - sum(want(down))) / (2 * h)
            assert autograd[i].item() == pytest.approx(numeric, abs=1e-6), (column, i)


def test_aot_sorts_across_the_batch_and_is_sigmoid_for_a_single_pair():
    params = LossParams(beta=BETA, label_smoothing=EPS)
    for name in ("aot", "aot_pair"):
        for row in PAIRS:
            single = get_loss(name)(pair_tensors([row]), params)
            assert single.item() == pytest.approx(expected("sigmoid", *row), abs=1e-9)
    # the ranks of the chosen and of the rejected log-ratios differ: the sorted pairing is not the given one
    batch = get_loss("aot_pair")(pair_tensors(), params)
    assert batch.tolist() != pytest.approx([expected("sigmoid", *row) for row in PAIRS], abs=1e-3)


@pytest.mark.parametrize("kind", ["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"])
def test_f_divergence_special_cases(kind):
    pairs = pair_tensors()
    params = LossParams(beta=BETA, label_smoothing=EPS, f_divergence_type=kind, f_alpha=1.0)
    got = get_loss("f_divergence")(pairs, params)
    if kind == "reverse_kl":  # reverse KL is DPO
        assert torch.allclose(got, get_loss("sigmoid")(pairs, params), atol=1e-12)
    if kind == "alpha_divergence":  # α = 1 is forward KL
        forward = params.model_copy(update={"f_divergence_type": "forward_kl"})
        assert torch.allclose(got, get_loss("f_divergence")(pairs, forward), atol=1e-12)
    far = pair_tensors([(-400.0, 0.0, 0.0, -400.0, 1, 1)], dtype=torch.float32)  # e^{400} overflows float32
    assert torch.isfinite(get_loss("f_divergence")(far, params)).all()


def test_reference_free_objectives_and_mixes():
    defaults = PreferenceHyperparameters()
    for names in ("simpo", "cpo", "orpo", "sft", ["simpo", "sft"]):
        assert not resolve_losses(names, None, defaults).needs_reference, names
    for names in ("sigmoid", "aot", "f_divergence", ["simpo", "sigmoid"]):
        assert resolve_losses(names, None, defaults).needs_reference, names


@pytest.mark.parametrize(
    "loss_type, hyperparameters, message",
    [
        (
            "sigmoid",
            {"simpo_gamma": 1.0},
            "simpo_gamma: 1.0 has no effect on \\['sigmoid'\\]; it is read by \\['simpo'\\]",
        ),
        ("simpo", {"cpo_alpha": 0.5}, "cpo_alpha: 0.5 has no effect"),
        ("cpo", {"orpo_lambda": 0.5}, "orpo_lambda: 0.5 has no effect"),
        ("orpo", {"label_smoothing": 0.1}, "label_smoothing: 0.1 has no effect on \\['orpo'\\]"),
        ("sigmoid", {"f_divergence_type": "js_divergence"}, "f_divergence_type: js_divergence has no effect"),
        ("f_divergence", {"f_alpha": 0.3}, "f_alpha: 0.3 has no effect with f_divergence_type: reverse_kl"),
    ],
)
def test_new_hyperparameters_without_a_reader_are_errors(loss_type, hyperparameters, message):
    with pytest.raises(ValueError, match=message):
        resolve_losses(loss_type, None, PreferenceHyperparameters(**hyperparameters))
    alpha = PreferenceHyperparameters(f_divergence_type="alpha_divergence", f_alpha=0.3)
    assert resolve_losses("f_divergence", None, alpha).names == ("f_divergence",)


def test_the_docs_loss_table_lists_every_registered_loss():
    page = (Path(__file__).parents[1] / "docs" / "algorithms" / "dpo.md").read_text()
    table = page.split("## DPO losses")[1].split("\n## ")[0]
    assert [name for name in sorted(PREFERENCE_LOSSES) if f"| `{name}` |" not in table] == []
