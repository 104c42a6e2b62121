"""GRPO math against formulas written out here: advantages, clipping, k3, each loss_type, rewards, and the
per-token objectives (clip at token and sequence level = GSPO, cispo, sapo) and add-ons, in fp64 with gradients."""

import concurrent.futures
import math
import statistics
from pathlib import Path

import pytest
import torch

from trainers.grpo.losses import (
    ADVANTAGE_ESTIMATORS,
    GRPO_LOSSES,
    IMPORTANCE_LEVELS,
    POLICY_OBJECTIVES,
    REWARD_SCALES,
    ObjectiveParams,
    bias_corrected_k3_kl,
    clip_fractions,
    clipped_surrogate,
    get_grpo_loss,
    get_policy_objective,
    group_advantages,
    high_entropy_mask,
    k3_kl,
    normalized_advantages,
    sapo_objective,
    sequence_kl,
    sequence_log_ratio,
    token_entropy,
    token_log_ratio,
    weighted_rewards,
)
from trainers.grpo.rewards import REWARD_FUNCTIONS, RewardError, allow_module, get_reward, score_completions

pytestmark = pytest.mark.unit

F64 = torch.float64
REWARDS = [1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 0.0, 0.0, 0.0, 3.0]  # 3 prompts x G = 4


def test_group_advantages_group_batch_and_none():
    groups = [REWARDS[i : i + 4] for i in range(0, 12, 4)]
    eps = 1e-4
    expected_group = [(r - statistics.mean(g)) / (statistics.stdev(g) + eps) for g in groups for r in g]
    expected_batch = [(r - statistics.mean(g)) / (statistics.stdev(REWARDS) + eps) for g in groups for r in g]
    expected_none = [r - statistics.mean(g) for g in groups for r in g]
    rewards = torch.tensor(REWARDS)
    assert group_advantages(rewards, 4, "group").tolist() == pytest.approx(expected_group, abs=1e-5)
    assert group_advantages(rewards, 4, "batch").tolist() == pytest.approx(expected_batch, abs=1e-5)
    assert group_advantages(rewards, 4, "none").tolist() == pytest.approx(expected_none, abs=1e-6)
    assert group_advantages(rewards, 4, "group")[4:8].tolist() == [0.0] * 4  # equal rewards carry no signal
    with pytest.raises(ValueError, match="unknown scale_rewards 'rank'"):
        group_advantages(rewards, 4, "rank")


def test_rloo_advantages_are_each_reward_minus_the_mean_of_the_others():
    groups = [REWARDS[i : i + 4] for i in range(0, 12, 4)]
    others = [[(sum(g) - r) / 3 for r in g] for g in groups]
    expected_none = [r - b for g, bs in zip(groups, others) for r, b in zip(g, bs)]
    expected_group = [(r - b) / (statistics.stdev(g) + 1e-4) for g, bs in zip(groups, others) for r, b in zip(g, bs)]
    rewards = torch.tensor(REWARDS, dtype=F64)
    assert group_advantages(rewards, 4, "none", "rloo").tolist() == pytest.approx(expected_none, abs=1e-12)
    assert group_advantages(rewards, 4, "group", "rloo").tolist() == pytest.approx(expected_group, abs=1e-12)
    # k/(k − 1) times GRPO's centred reward; they sum to 0 in each group
    grpo = group_advantages(rewards, 4, "none", "grpo")
    assert group_advantages(rewards, 4, "none", "rloo").tolist() == pytest.approx((grpo * 4 / 3).tolist(), abs=1e-12)
    # unscored completions (NaN) are left out of the others' mean, and a lone scored one gets 0
    scored = torch.tensor([1.0, math.nan, 4.0, 7.0, math.nan, 2.0, math.nan, math.nan], dtype=F64)
    got = group_advantages(scored, 4, "none", "rloo").tolist()
    assert got == pytest.approx([1 - 5.5, 0.0, 4 - 4.0, 7 - 2.5, 0.0, 0.0, 0.0, 0.0], abs=1e-12)
    with pytest.raises(ValueError, match="unknown advantage_estimator 'ppo'"):
        group_advantages(rewards, 4, "none", "ppo")


def test_clipping_with_hand_made_ratios():
    ratios = [0.5, 0.9, 1.0, 1.1, 1.5]
    logps = torch.tensor([[math.log(r) for r in ratios]] * 2, requires_grad=True)
    old = torch.zeros(2, 5)
    advantages = torch.tensor([1.0, -1.0])
    loss = clipped_surrogate(logps, old, advantages, epsilon_low=0.2, epsilon_high=0.28)
    # A = +1: −min(ρ, clip(ρ, 0.8, 1.28)); A = −1: max(ρ, clip(ρ, 0.8, 1.28))
    assert loss[0].tolist() == pytest.approx([-0.5, -0.9, -1.0, -1.1, -1.28], abs=1e-6)
    assert loss[1].tolist() == pytest.approx([0.8, 0.9, 1.0, 1.1, 1.5], abs=1e-6)
    loss.sum().backward()
    # d/dlogp of −Aρ is −Aρ where the unclipped term is the minimum, 0 where the clip binds
    assert logps.grad[0].tolist() == pytest.approx([-0.5, -0.9, -1.0, -1.1, 0.0], abs=1e-6)
    assert logps.grad[1].tolist() == pytest.approx([0.0, 0.9, 1.0, 1.1, 1.5], abs=1e-6)
    low, high = clip_fractions(logps.detach(), old, advantages, torch.ones(2, 5), 0.2, 0.28)
    assert (low.item(), high.item()) == pytest.approx((0.1, 0.1))


def test_k3_kl_formula():
    logps, ref = torch.tensor([[-1.0, -2.0, -0.5]]), torch.tensor([[-1.5, -2.0, 0.0]])
    expected = [math.exp(d) - d - 1 for d in (-0.5, 0.0, 0.5)]
    assert k3_kl(logps, ref)[0].tolist() == pytest.approx(expected, abs=1e-6)


PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 5.0, 100.0, 100.0], [7.0, 100.0, 100.0, 100.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])  # row 3 counts nothing


@pytest.mark.parametrize(
    "loss_type, expected",
    [
        ("grpo", ((1 + 2 + 3) / 3 + (4 + 5) / 2 + 0) / 3),  # mean over sequences of token means
        ("bnpo", (1 + 2 + 3 + 4 + 5) / 5),  # mean over counted tokens
        ("dr_grpo", (1 + 2 + 3 + 4 + 5) / (3 * 8)),  # sum / (B · max_completion_length)
        ("dapo", (1 + 2 + 3 + 4 + 5) / 7.5),  # sum / (generation batch tokens per step)
        ("luspo", (1 + 2 + 3 + 4 + 5) / 3),  # sum / B
    ],
)
def test_each_loss_type_against_its_formula(loss_type, expected):
    loss = get_grpo_loss(loss_type)(PER_TOKEN, MASK, max_completion_length=8, tokens_per_step=7.5)
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def test_luspo_weights_each_sequence_loss_by_its_length():
    """At sequence level every token of a completion carries the same loss ℓ_i ([B, 1]): LUSPO is
    Σ_i |o_i| ℓ_i / B."""
    sequence_losses = torch.tensor([[2.0], [-3.0], [5.0]], dtype=F64, requires_grad=True)
    lengths = MASK.sum(-1).tolist()  # 3, 2, 0
    expected = sum(n * loss for n, loss in zip(lengths, [2.0, -3.0, 5.0])) / 3
    got = get_grpo_loss("luspo")(sequence_losses, MASK.to(F64), max_completion_length=8, tokens_per_step=7.5)
    assert got.item() == pytest.approx(expected, abs=1e-12)
    got.backward()
    assert sequence_losses.grad.flatten().tolist() == pytest.approx([n / 3 for n in lengths], abs=1e-12)  # |o_i| / B


def test_unknown_loss_types_and_reward_scales_are_rejected_by_name():
    with pytest.raises(ValueError, match="unknown loss_type 'ppo'"):
        get_grpo_loss("ppo")
    with pytest.raises(ValueError, match="unknown scale_rewards 'mad'"):
        group_advantages(torch.tensor(REWARDS), 4, "mad")


def test_builtin_rewards_none_rows_and_weighted_sum():
    completions = ["68", " 68 ", "67", "6 8", "abc"]
    answers = ["68", "68", "68", None, "1"]
    ids = [[1, 2], [1, 2, 3, 4], [1, 2], [1, 2, 3], [1, 2, 3]]
    functions = [(n, get_reward(n)) for n in ("correctness", "format", "length_penalty")]
    scores = torch.tensor(
        score_completions(
            functions, {"prompts": ["p"] * 5, "completions": completions, "answer": answers, "completion_ids": ids}
        )
    )
    assert scores[0, :3].tolist() == [1.0, 1.0, 0.0] and math.isnan(scores[0, 3]) and scores[0, 4] == 0.0
    assert scores[1].tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert scores[2].tolist() == [-2.0, -4.0, -2.0, -3.0, -3.0]
    total = weighted_rewards(scores, torch.tensor([1.0, 0.5, 0.1]))
    # row 3: correctness is None and is left out of the sum rather than poisoning it
    assert total.tolist() == pytest.approx([1.3, 1.1, 0.3, -0.3, -0.3], abs=1e-6)


def test_unscored_completions_are_missing_from_the_group_statistics():
    nan = math.nan
    rewards = torch.tensor([1.0, nan, 0.0, 1.0, nan, nan, nan, nan, 2.0, 2.0, nan, 5.0])
    scored = [[1.0, 0.0, 1.0], [], [2.0, 2.0, 5.0]]
    eps = 1e-4
    first = [(r - 2 / 3) / (statistics.stdev(scored[0]) + eps) for r in (1.0, 0.0, 1.0)]
    third = [(r - 3.0) / (statistics.stdev(scored[2]) + eps) for r in (2.0, 2.0, 5.0)]
    expected = [first[0], 0.0, first[1], first[2], 0.0, 0.0, 0.0, 0.0, third[0], third[1], 0.0, third[2]]
    assert group_advantages(rewards, 4, "group").tolist() == pytest.approx(expected, abs=1e-5)
    batch_spread = statistics.stdev(scored[0] + scored[2]) + eps
    assert group_advantages(rewards, 4, "batch")[[0, 1, 11]].tolist() == pytest.approx(
        [(1.0 - 2 / 3) / batch_spread, 0.0, 2.0 / batch_spread], abs=1e-5
    )
    assert group_advantages(rewards, 4, "none")[[2, 5, 8]].tolist() == pytest.approx([-2 / 3, 0.0, -1.0], abs=1e-6)
    # a row that no function scored is NaN (missing), one that some function scored is their sum
    scores = torch.tensor([[1.0, nan, nan], [0.5, 2.0, nan]])
    total = weighted_rewards(scores, torch.tensor([1.0, 2.0]))
    assert total[:2].tolist() == [2.0, 4.0] and math.isnan(total[2])


def test_math_verify_compares_final_answers_symbolically_on_any_thread():
    pytest.importorskip("math_verify")  # alignflow[math]; the test extras install it
    math_verify = get_reward("math_verify")
    completions = [
        "The sum is \\boxed{\\frac{1}{2}}.",
        "so the answer is 12",
        [{"role": "assistant", "content": "x = 3/4"}],
        "it is 13",
        "no number here",
        "7",
    ]
    answers = ["0.5", "12", "0.75", "12", "12", None]
    assert math_verify(completions=completions, answer=answers) == [1.0, 1.0, 1.0, 0.0, 0.0, None]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # as from a worker thread: no SIGALRM there
        assert pool.submit(math_verify, completions=completions[:2], answer=answers[:2]).result() == [1.0, 1.0]
    with pytest.raises(ValueError, match="reward 'math_verify' needs a dataset column 'answer'"):
        math_verify(completions=completions)


def test_reward_names_resolve_by_registry_or_import_path():
    assert get_reward("format") is REWARD_FUNCTIONS["format"]
    allow_module("trainers.grpo.rewards")  # as a config listing it in `plugins` does
    assert get_reward("trainers.grpo.rewards:length_penalty") is REWARD_FUNCTIONS["length_penalty"]
    assert get_reward("trainers.grpo.rewards.correctness") is REWARD_FUNCTIONS["correctness"]
    with pytest.raises(ValueError, match="unknown reward function 'nope'"):
        get_reward("nope")
    with pytest.raises(ValueError, match="'trainers.grpo.rewards:missing' cannot be imported"):
        get_reward("trainers.grpo.rewards:missing")
    with pytest.raises(ValueError, match="needs a dataset column 'answer'"):
        get_reward("correctness")(prompts=["p"], completions=["1"])
    with pytest.raises(RewardError, match="'format' returned 1 values for 2 completions"):
        score_completions(
            [("format", lambda completions, **_: [1.0])], {"prompts": ["p", "q"], "completions": ["1", "2"]}
        )


# ---- per-token objectives, importance levels and add-ons (fp64, against formulas written out here) ----

LOGPS = [[-1.2, -0.3, -2.0, -0.7], [-0.5, -1.5, -0.9, -3.0], [-0.1, -2.5, -0.4, -1.1]]
OLD = [[-1.0, -0.9, -2.1, -0.2], [-0.6, -1.1, -0.2, -3.0], [-0.3, -2.0, -0.4, -1.0]]
ADVANTAGES = [1.3, -0.8, 0.4]
TOKEN_MASK = [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]


def leaf(values):
    return torch.tensor(values, dtype=F64, requires_grad=True)


def params(**overrides):
    values = dict(epsilon_low=0.2, epsilon_high=0.28) | overrides
    return ObjectiveParams(**values)


def grpo_mean(per_row_token_losses):
    """GRPO's aggregation written out: mean over rows of each row's mean over its counted tokens."""
    return sum(sum(row) / len(row) for row in per_row_token_losses) / len(per_row_token_losses)


def counted(row):
    return [t for t, m in enumerate(TOKEN_MASK[row]) if m]


def check_against(ours_loss, ours_logps, theirs_loss, theirs_logps):
    """Values and gradients (w.r.t. the log-probs) agree to 1e-6 in fp64."""
    assert ours_loss.item() == pytest.approx(theirs_loss.item(), abs=1e-6)
    (ours_grad,) = torch.autograd.grad(ours_loss, ours_logps)
    (theirs_grad,) = torch.autograd.grad(theirs_loss, theirs_logps)
    assert torch.allclose(ours_grad, theirs_grad, atol=1e-6, rtol=0)
    assert ours_grad.abs().max() > 1e-3  # the comparison is not between two zeros
    return ours_grad


def our_loss(objective, level, logps, old=OLD, advantages=ADVANTAGES, mask=TOKEN_MASK, **overrides):
    mask = torch.tensor(mask, dtype=F64)
    old = torch.tensor(old, dtype=F64)
    log_ratio = IMPORTANCE_LEVELS.lookup(level).log_ratio(logps, old, mask)
    per_token = get_policy_objective(objective)(
        log_ratio, logps, torch.tensor(advantages, dtype=F64), params(**overrides)
    )
    return get_grpo_loss("grpo")(per_token, mask, max_completion_length=4, tokens_per_step=1.0)


def test_sequence_ratio_is_the_length_normalised_geometric_mean():
    logps = torch.tensor(LOGPS, dtype=F64)
    got = sequence_log_ratio(logps, torch.tensor(OLD, dtype=F64), torch.tensor(TOKEN_MASK, dtype=F64))
    assert got.shape == (3, 1)
    for i in range(3):
        ratios = [math.exp(LOGPS[i][t] - OLD[i][t]) for t in counted(i)]
        geometric_mean = math.prod(ratios) ** (1 / len(ratios))
        assert math.exp(got[i, 0].item()) == pytest.approx(geometric_mean, abs=1e-12)
    assert token_log_ratio(logps, torch.tensor(OLD, dtype=F64), None).flatten().tolist() == pytest.approx(
        [a - b for x, y in zip(LOGPS, OLD) for a, b in zip(x, y)], abs=1e-12
    )


@pytest.mark.parametrize("delta", [None, 1.5])
def test_gspo_clip_objective_against_its_formula(delta):
    """GSPO: J_i = min(s_i A_i, clip(s_i, 1 − ε, 1 + ε_high) A_i) per completion, s_i the geometric mean
    ratio; the ε here (0.05 / 0.1) let some rows clip and some not."""
    ours = leaf(LOGPS)
    loss = our_loss("clip", "sequence", ours, epsilon_low=0.05, epsilon_high=0.1, delta=delta)

    theirs = leaf(LOGPS)
    rows = []
    for i in range(3):
        tokens = counted(i)
        s = torch.exp(sum(theirs[i, t] - OLD[i][t] for t in tokens) / len(tokens))
        a = ADVANTAGES[i]
        unclipped = torch.clamp(s, max=delta) * a if delta is not None else s * a
        objective = torch.minimum(unclipped, torch.clamp(s, 0.95, 1.1) * a)
        rows.append([-objective] * len(tokens))
    grad = check_against(loss, ours, grpo_mean(rows), theirs)
    # every counted token of a row gets the same gradient (s_i A_i / |o_i| / B where unclipped)
    for i in range(3):
        assert len({round(grad[i, t].item(), 12) for t in counted(i)}) == 1


def test_gspo_equals_token_level_grpo_when_every_completion_has_one_token():
    mask = [[0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 1]]
    token, sequence = leaf(LOGPS), leaf(LOGPS)
    same = dict(mask=mask, epsilon_low=0.05, epsilon_high=0.1)
    token_loss = our_loss("clip", "token", token, **same)
    sequence_loss = our_loss("clip", "sequence", sequence, **same)
    check_against(sequence_loss, sequence, token_loss, token)


def test_gspo_differs_from_token_level_in_the_direction_the_paper_predicts():
    """One positive-advantage completion of two tokens: one token's probability rose (ρ = e^0.5), the
    other's fell (ρ = e^-0.5), so the sequence ratio is exactly 1 (geometric mean).

    Token level, each token is weighted by its own ρ_t, and the clip zeroes the gradient of the token
    that already rose: GRPO reinforces only the token that fell. GSPO (Zheng et al., 2025) weights all
    tokens of a completion alike, by s_i = 1: it reinforces both equally, the whole completion at once.
    A completion whose sequence ratio left the range gets no gradient at all under GSPO, while token
    level still trains its in-range tokens."""
    old = [[-1.0, -1.0]]
    mask = [[1, 1]]
    logps_values = [[-0.5, -1.5]]
    token, sequence = leaf(logps_values), leaf(logps_values)
    our_loss("clip", "token", token, old=old, advantages=[1.0], mask=mask).backward()
    our_loss("clip", "sequence", sequence, old=old, advantages=[1.0], mask=mask).backward()
    assert token.grad[0, 0] == 0.0 and token.grad[0, 1] < 0  # descent raises only the token that fell
    assert sequence.grad[0, 0] < 0 and sequence.grad[0, 1] < 0  # descent raises both ...
    assert sequence.grad[0, 0].item() == pytest.approx(sequence.grad[0, 1].item(), abs=1e-12)  # ... equally
    assert sequence.grad[0, 0].item() == pytest.approx(-0.5, abs=1e-12)  # −s·A/|o| with s = 1
    assert token.grad[0, 1].item() == pytest.approx(-math.exp(-0.5) / 2, abs=1e-12)  # −ρ_t·A/|o|

    drifted = [[-0.9, -0.95]]  # both in token range [0.8, 1.28], but s = e^0.075 > 1 + 4e-4
    token, sequence = leaf(drifted), leaf(drifted)
    our_loss("clip", "token", token, old=old, advantages=[1.0], mask=mask).backward()
    gspo = dict(epsilon_low=3e-4, epsilon_high=4e-4)
    our_loss("clip", "sequence", sequence, old=old, advantages=[1.0], mask=mask, **gspo).backward()
    assert (token.grad < 0).all() and (sequence.grad == 0).all()


def test_two_sided_clipping_caps_only_negative_advantages():
    ratios = [0.5, 1.0, 1.5, 3.0, 6.0]
    logps = leaf([[math.log(r) for r in ratios]] * 2)
    old = torch.zeros(2, 5, dtype=F64)
    advantages = torch.tensor([1.0, -2.0], dtype=F64)
    loss = clipped_surrogate(logps, old, advantages, 0.2, 0.28, delta=4.0)
    plain = clipped_surrogate(logps.detach(), old, advantages, 0.2, 0.28)
    # A = −2: ℓ = −min(min(ρ, 4)·(−2), clip(ρ, 0.8, 1.28)·(−2)) = 2·max(min(ρ, 4), clip(ρ))
    expected = [2 * max(min(r, 4.0), min(max(r, 0.8), 1.28)) for r in ratios]
    assert loss[1].tolist() == pytest.approx(expected, abs=1e-12)
    assert torch.equal(loss[0], plain[0])  # A > 0: δ > 1 + ε_high changes nothing
    loss.sum().backward()
    # d/dlogρ of 2·min(ρ, 4) is 2ρ below δ and 0 above; the clip binds (0) only for ρ < 0.8
    assert logps.grad[1].tolist() == pytest.approx([0.0, 2.0, 3.0, 6.0, 0.0], abs=1e-12)


def test_cispo_against_its_formula():
    """ℓ_t = −sg(min(ρ_t, ρ_max)) A log π_t: value and gradient −min(ρ_t, ρ_max) A; weights above the
    cap (and, at sequence level, the shared s_i) are written out independently."""
    cap = 1.5
    for level in ("token", "sequence"):
        ours = leaf(LOGPS)
        loss = our_loss("cispo", level, ours, cispo_max_ratio=cap)
        theirs = leaf(LOGPS)
        rows = []
        for i in range(3):
            tokens = counted(i)
            if level == "token":
                weights = [min(math.exp(LOGPS[i][t] - OLD[i][t]), cap) for t in tokens]
            else:
                s = math.exp(sum(LOGPS[i][t] - OLD[i][t] for t in tokens) / len(tokens))
                weights = [min(s, cap)] * len(tokens)
            rows.append([-w * ADVANTAGES[i] * theirs[i, t] for w, t in zip(weights, tokens)])
        grad = check_against(loss, ours, grpo_mean(rows), theirs)
        if level == "token":  # the cap binds somewhere, and the capped token still gets a gradient
            assert math.exp(LOGPS[0][1] - OLD[0][1]) > cap and grad[0, 1] != 0


def test_objective_metrics():
    ratio = torch.tensor([[0.5, 1.0, 3.0, 3.0], [0.7, 2.5, 1.0, 1.0]])
    advantages = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    capped = get_policy_objective("cispo").metrics(ratio, advantages, mask, params(cispo_max_ratio=2.0))
    assert capped["cispo/capped_fraction"].item() == pytest.approx(2 / 5)  # 3.0 and 2.5; the padded 3.0 not
    clip = get_policy_objective("clip").metrics(ratio, advantages, mask, params())
    assert (clip["clip_ratio/low_mean"].item(), clip["clip_ratio/high_mean"].item()) == pytest.approx((1 / 5, 1 / 5))
    sequence = get_policy_objective("clip").metrics(torch.tensor([[1.5], [1.0]]), advantages, mask, params())
    assert sequence["clip_ratio/high_mean"].item() == pytest.approx(3 / 5)  # a clipped sequence counts per token
    assert get_policy_objective("sapo").metrics is None


def test_sapo_against_its_formula():
    tau_pos, tau_neg = 1.0, 1.05
    for level in ("token", "sequence"):
        ours = leaf(LOGPS)
        loss = our_loss("sapo", level, ours, sapo_temperature_pos=tau_pos, sapo_temperature_neg=tau_neg)
        theirs = leaf(LOGPS)
        rows = []
        for i in range(3):
            tokens = counted(i)
            a = ADVANTAGES[i]
            tau = tau_pos if a > 0 else tau_neg
            if level == "token":
                ratios = [torch.exp(theirs[i, t] - OLD[i][t]) for t in tokens]
            else:
                ratios = [torch.exp(sum(theirs[i, t] - OLD[i][t] for t in tokens) / len(tokens))] * len(tokens)
            rows.append([-(4 / tau) * torch.sigmoid(tau * (r - 1)) * a for r in ratios])
        check_against(loss, ours, grpo_mean(rows), theirs)

    # gradient in closed form, −4σ(1 − σ)·ρ·A, and −A on-policy
    logps = leaf([[math.log(0.7), 0.0, math.log(1.6)]])
    per_token = sapo_objective(logps, logps, torch.tensor([-1.0], dtype=F64), params())
    per_token.sum().backward()
    for r, g in zip((0.7, 1.0, 1.6), logps.grad[0].tolist()):
        sigma = 1 / (1 + math.exp(-tau_neg * (r - 1)))
        assert g == pytest.approx(4 * sigma * (1 - sigma) * r, abs=1e-12)
    assert logps.grad[0, 1].item() == pytest.approx(1.0, abs=1e-12)


def test_objectives_finite_difference_gradients():
    """The same gradients, checked by finite differences instead of a second formula."""
    mask = torch.tensor(TOKEN_MASK, dtype=F64)
    old = torch.tensor(OLD, dtype=F64)
    advantages = torch.tensor(ADVANTAGES, dtype=F64)
    for name, level, extra in [
        ("clip", "sequence", dict(epsilon_low=0.05, epsilon_high=0.1, delta=1.2)),
        ("sapo", "token", {}),
        ("sapo", "sequence", {}),
    ]:
        objective, log_ratio = get_policy_objective(name), IMPORTANCE_LEVELS.lookup(level).log_ratio

        def loss(logps, objective=objective, log_ratio=log_ratio, extra=extra):
            per_token = objective(log_ratio(logps, old, mask), logps, advantages, params(**extra))
            return get_grpo_loss("bnpo")(per_token, mask, max_completion_length=4, tokens_per_step=1.0)

        assert torch.autograd.gradcheck(loss, (leaf(LOGPS),), eps=1e-6, atol=1e-6)


def test_bias_corrected_kl_value_and_gradient():
    ref = [[-1.0, -0.2, -2.5], [-0.4, -1.0, -0.1]]
    logps_values = [[-1.2, -0.3, -2.0], [-0.5, -1.5, -0.9]]
    old = [[-1.0, -0.9, -2.1], [-0.5, -1.5, -0.9]]  # row 2 on-policy
    logps = leaf(logps_values)
    kl = bias_corrected_k3_kl(logps, torch.tensor(old, dtype=F64), torch.tensor(ref, dtype=F64))
    kl.sum().backward()
    for i in range(2):
        for t in range(3):
            lp, o, r = logps_values[i][t], old[i][t], ref[i][t]
            rho, k3 = math.exp(lp - o), math.exp(r - lp) - (r - lp) - 1
            assert kl[i, t].item() == pytest.approx(rho * k3, abs=1e-12)
            # d/dlp [ρ·k3] = ρ·k3 + ρ·(1 − e^{r − lp})
            assert logps.grad[i, t].item() == pytest.approx(rho * k3 + rho * (1 - math.exp(r - lp)), abs=1e-12)
    # on-policy the value is plain k3 but the gradient is log π − log π_ref (reverse-KL score), not 1 − π_ref/π
    plain = leaf(logps_values)
    k3_kl(plain, torch.tensor(ref, dtype=F64)).sum().backward()
    for t in range(3):
        lp, r = logps_values[1][t], ref[1][t]
        assert logps.grad[1, t].item() == pytest.approx(lp - r, abs=1e-12)
        assert plain.grad[1, t].item() == pytest.approx(1 - math.exp(r - lp), abs=1e-12)


def test_token_entropy_and_its_gradient():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5, dtype=F64, requires_grad=True)
    entropy = token_entropy(logits)
    weights = torch.randn(2, 3, dtype=F64)
    (entropy * weights).sum().backward()
    for b in range(2):
        for t in range(3):
            z = logits[b, t].tolist()
            norm = math.log(sum(math.exp(v) for v in z))
            p = [math.exp(v - norm) for v in z]
            h = -sum(pv * math.log(pv) for pv in p)
            assert entropy[b, t].item() == pytest.approx(h, abs=1e-12)
            # ∂H/∂z_v = −p_v (log p_v + H)
            expected = [-pv * (math.log(pv) + h) * weights[b, t].item() for pv in p]
            assert logits.grad[b, t].tolist() == pytest.approx(expected, abs=1e-12)
    assert token_entropy(torch.zeros(1, 1, 7)).item() == pytest.approx(math.log(7), abs=1e-6)


def linear_quantile(values, q):
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (position - below) * (ordered[above] - ordered[below])


@pytest.mark.parametrize("quantile", [0.2, 0.5, 1.0, 0.0])
def test_high_entropy_mask_keeps_the_top_quantile_of_counted_tokens(quantile):
    entropy = torch.tensor([[0.1, 2.0, 0.7, 9.0], [1.5, 0.3, 50.0, 0.0], [0.9, 1.1, 2.5, 0.2]], dtype=F64)
    mask = torch.tensor(TOKEN_MASK, dtype=F64)  # the 9.0 and 50.0 sit on padding and must not count
    values = [entropy[i, t].item() for i in range(3) for t in counted(i)]
    threshold = linear_quantile(values, 1 - quantile)
    expected = [[float(TOKEN_MASK[i][t] and entropy[i, t].item() >= threshold) for t in range(4)] for i in range(3)]
    got = high_entropy_mask(entropy, mask, quantile)
    assert got.tolist() == expected
    assert got.sum().item() == {0.2: 2, 0.5: 5, 1.0: 9, 0.0: 1}[quantile]  # of the 9 counted tokens
    assert high_entropy_mask(entropy, torch.zeros_like(mask), quantile).sum() == 0


def test_unknown_objectives_and_levels_are_rejected_by_name():
    with pytest.raises(ValueError, match="unknown policy_loss 'ppo'"):
        get_policy_objective("ppo")
    with pytest.raises(ValueError, match="unknown importance_sampling_level 'segment'"):
        IMPORTANCE_LEVELS.lookup("segment")
    assert sorted(POLICY_OBJECTIVES) == ["cispo", "clip", "sapo"]
    assert sorted(IMPORTANCE_LEVELS) == ["sequence", "token"]


def test_the_docs_tables_list_every_registered_objective_level_and_aggregation():
    page = (Path(__file__).resolve().parents[1] / "docs" / "algorithms" / "grpo.md").read_text()
    section = page[page.index("## GRPO objectives") :]
    for name in [*POLICY_OBJECTIVES, *IMPORTANCE_LEVELS]:
        assert f"| `{name}` |" in section, name
    for name in GRPO_LOSSES:
        assert f"`{name}`" in section, name
    rows = {line.split(" | ")[0].strip("| `"): line for line in page.splitlines() if line.startswith("| `grpo.")}
    for option, registry in (("grpo.advantage_estimator", ADVANTAGE_ESTIMATORS), ("grpo.scale_rewards", REWARD_SCALES)):
        assert all(f"`{name}`" in rows[option] for name in registry), option


def test_the_reward_side_kl_sums_each_completions_log_ratio_to_the_reference():
    old = torch.tensor([[0.0, -1.0, -2.0, -0.5], [-0.3, -0.2, -4.0, -1.0]], dtype=F64)
    ref = torch.tensor([[-9.0, -1.5, -1.0, -0.5], [-0.1, -0.7, -3.0, -2.0]], dtype=F64)
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]], dtype=F64)
    # row 0: (−1 + 1.5) + (−2 + 1); row 1: (−0.3 + 0.1) + (−0.2 + 0.7) + (−4 + 3) + (−1 + 2)
    assert sequence_kl(old, ref, mask).tolist() == pytest.approx([-0.5, 0.3], abs=1e-12)


def test_normalised_advantages_have_mean_zero_and_unit_std_over_the_scored_completions():
    advantages = torch.tensor([1.0, 0.0, 3.0, -2.0, 0.0], dtype=F64)
    scored = torch.tensor([True, False, True, True, True])
    got = normalized_advantages(advantages, scored)
    values = [1.0, 3.0, -2.0, 0.0]
    mean = sum(values) / 4
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / 3)
    want = [
        (1.0 - mean) / (std + 1e-4),
        0.0,
        (3.0 - mean) / (std + 1e-4),
        (-2.0 - mean) / (std + 1e-4),
        (0.0 - mean) / (std + 1e-4),
    ]
    assert got.tolist() == pytest.approx(want, abs=1e-12)
