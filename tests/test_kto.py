"""KTO: the loss and its reference point against the paper's formulas written here (float64, value
and gradient), the unpairing and KL pairing of the data, the config check, training steps of the
trainer against a per-sequence formula, with a live reference and with cached reference log-probs."""

from __future__ import annotations

import copy
import math

import datasets
import pytest
import torch
from helpers import QUIET_TRAINING, launch_worker
from pydantic import ValidationError

from infra.core.config import load_config
from trainers.catalog import STAGES
from trainers.kto.data import KL_COMPLETION, kl_partners, kto_splits, unpaired, with_kl_completions
from trainers.kto.trainer import KTOConfig, KTOTrainer, UnpairedCollator, kl_reference_point, kto_losses

BETA, WD, WU = 0.3, 1.5, 0.7


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


@pytest.mark.unit
def test_kto_losses_match_the_paper_in_float64_with_their_gradient():
    values = [0.4, -1.2, 2.0, -0.3, 0.0]
    desirable = [True, False, True, False, True]
    z0 = 0.25
    logratios = torch.tensor(values, dtype=torch.float64, requires_grad=True)
    got = kto_losses(logratios, torch.tensor(desirable), torch.tensor(z0, dtype=torch.float64), BETA, WD, WU)
    want = [
        WD * (1 - sigmoid(BETA * (r - z0))) if d else WU * (1 - sigmoid(BETA * (z0 - r)))
        for r, d in zip(values, desirable)
    ]
    assert got.dtype == torch.float64
    assert got.tolist() == pytest.approx(want, abs=1e-12)
    got.sum().backward()
    # d/dr of λ(1 − σ(±β(r − z0))) = ∓λβ σ(s)(1 − σ(s)), s = ±β(r − z0)
    grads = []
    for r, d in zip(values, desirable):
        s = BETA * (r - z0) if d else BETA * (z0 - r)
        grads.append((-1 if d else 1) * (WD if d else WU) * BETA * sigmoid(s) * (1 - sigmoid(s)))
    assert logratios.grad.tolist() == pytest.approx(grads, abs=1e-12)


@pytest.mark.unit
def test_the_reference_point_is_the_clamped_mean_kl_without_gradient():
    kl = torch.tensor([0.5, -0.1, 0.2], requires_grad=True)
    point = kl_reference_point(kl)
    assert point.item() == pytest.approx(0.2) and not point.requires_grad
    assert kl_reference_point(torch.tensor([-0.5, 0.1])).item() == 0.0  # max(0, ·)
    # every process's KL rows, gathered: the mean of all, then the clamp (one process's mean, −0.6, is
    # negative; clamping it first would give (0.8 + 0) / 2)
    gathered = torch.tensor([1.0, 0.6, -0.4, -0.8], dtype=torch.float64)
    assert kl_reference_point(gathered).item() == pytest.approx(max(0.0, (1.0 + 0.6 - 0.4 - 0.8) / 4), abs=1e-12)


@pytest.mark.unit
def test_pairs_unpair_in_order_and_each_row_carries_its_partners_completion_for_kl():
    pairs = [
        {"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3]},
        {"prompt_ids": [4], "chosen_ids": [5], "rejected_ids": [6, 7]},
    ]
    rows = unpaired(datasets.Dataset.from_list(pairs))
    assert rows == [
        {"prompt_ids": [1], "completion_ids": [2], "label": True},
        {"prompt_ids": [1], "completion_ids": [3], "label": False},
        {"prompt_ids": [4], "completion_ids": [5], "label": True},
        {"prompt_ids": [4], "completion_ids": [6, 7], "label": False},
    ]
    partners = kl_partners(4, "kto")
    kto_rows = with_kl_completions(rows)
    assert kto_rows == [row | {KL_COMPLETION: rows[partner]["completion_ids"]} for row, partner in zip(rows, partners)]
    batch = UnpairedCollator(pad_token_id=0)(kto_rows[1:])
    kl = [rows[partners[i]]["completion_ids"] for i in (1, 2, 3)]
    want = [[1, 3], [4, 5], [4, 6, 7], [1, *kl[0]], [4, *kl[1]], [4, *kl[2]]]
    assert batch["input_ids"].tolist() == [ids + [0] * (3 - len(ids)) for ids in want]
    assert batch["completion_mask"].tolist() == [[0] + [1] * (len(ids) - 1) + [0] * (3 - len(ids)) for ids in want]
    assert batch["desirable"].tolist() == [False, True, False] and "ref_logps" not in batch


@pytest.mark.unit
def test_kl_partners_are_one_fixed_cycle_through_every_row():
    for count in range(2, 40):
        partners = kl_partners(count, "kto")
        assert sorted(partners) == list(range(count)) and partners == kl_partners(count, "kto")
        row, seen = 0, []
        for _ in range(count):  # one cycle: following partners from row 0 visits every row once
            seen.append(row)
            row = partners[row]
        assert row == 0 and sorted(seen) == list(range(count))
    assert kl_partners(6, "kto") != [1, 2, 3, 4, 5, 0]  # shuffled: a shift would pair a pair's two halves


@pytest.mark.unit
def test_a_batch_may_hold_one_row_but_a_split_of_one_row_has_no_kl_partner():
    """The KL partners are fixed over the split, not drawn from the batch (TRL's in-batch shift
    needs two rows per device)."""
    assert load_config(None, ["stages=[sft, kto]", "kto.per_device_train_batch_size=1"]).kto.beta == 0.1
    one = {"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3]}
    assert len(kto_splits({"preference": [one]})["kto"]) == 2  # one pair: two rows, partners of each other
    with pytest.raises(ValueError, match="split 'unpaired': KTO's KL estimate .* at least 2 rows, got 1"):
        kto_splits({"unpaired": [{"prompt_ids": [1], "completion_ids": [2], "label": True}]})


@pytest.fixture(scope="module")
def pairs(tiny_pairs):
    return tiny_pairs[:16]


def make_trainer(policy, ref_model, tokenizer, pairs, tmp_path, **settings):
    settings = dict(per_device_train_batch_size=8, learning_rate=1e-3, beta=BETA, reference="live") | settings
    args = KTOConfig(output_dir=str(tmp_path), **QUIET_TRAINING, **settings)
    return KTOTrainer(
        model=policy,
        ref_model=ref_model,
        args=args,
        train_dataset=with_kl_completions(unpaired(pairs)),
        data_collator=UnpairedCollator(tokenizer.pad_token_id),
    )


def sequence_logp(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """Σ_t log p(y_t | x, y_<t) of one unpadded sequence, in float64, with plain log_softmax."""
    logits = model(torch.tensor([prompt + completion])).logits[0].double()
    positions = range(len(prompt) - 1, len(prompt) + len(completion) - 1)
    return sum(torch.log_softmax(logits[p], -1)[(prompt + completion)[p + 1]] for p in positions)


def policy_and_reference(model):
    """float64 copies of ``model``, the policy moved away from the reference: non-zero log-ratios and KL."""
    policy, reference = copy.deepcopy(model).double().eval(), copy.deepcopy(model).double().eval()
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.add_(0.02 * torch.randn_like(parameter, generator=torch.Generator().manual_seed(0)))
    return policy, reference


def loss_and_gradient(trainer, policy, batch) -> tuple[float, list[torch.Tensor]]:
    loss = trainer.compute_loss(policy, batch)
    loss.backward()
    gradient = [p.grad.clone() for p in policy.parameters()]
    policy.zero_grad()
    return loss.item(), gradient


@pytest.mark.slow
def test_cached_reference_logps_of_the_kto_view_give_the_live_references_loss_and_gradient(tiny, pairs, tmp_path):
    """The reference pass over the ``kto`` view's two completions (what the cache stores) stands in
    for the live reference model: the same loss and gradient, with no reference model loaded."""
    from trainers.kto.data import KTO_VIEW, REF_KL_LOGPS, REF_LOGPS
    from trainers.scoring.reference_pass import reference_logps

    model, tokenizer = tiny
    policy, reference = policy_and_reference(model)
    rows = with_kl_completions(unpaired(pairs[:4]))
    scored = reference_logps(
        reference, tokenizer.pad_token_id, rows, 3, progress=False, completions=KTO_VIEW.completions
    )
    cached_rows = [row | {REF_LOGPS: a, REF_KL_LOGPS: b} for row, a, b in zip(rows, *scored)]
    collate = UnpairedCollator(tokenizer.pad_token_id)
    live = make_trainer(policy, reference, tokenizer, pairs, tmp_path / "live")
    cached = make_trainer(policy, None, tokenizer, pairs, tmp_path / "cached", reference="cached")
    want, want_gradient = loss_and_gradient(live, policy, collate(rows))
    got, gradient = loss_and_gradient(cached, policy, collate(cached_rows))
    assert cached.ref_model is None and got == pytest.approx(want, abs=1e-6) and want != 0
    assert all(torch.allclose(g, w, atol=1e-6, rtol=0) for g, w in zip(gradient, want_gradient))
    with pytest.raises(ValueError, match="reference='cached' needs the columns"):
        cached.compute_loss(policy, collate(rows))


@pytest.mark.slow
def test_the_trainers_loss_and_gradient_equal_the_per_sequence_formula_in_float64(tiny, pairs, tmp_path):
    model, tokenizer = tiny
    policy, reference = policy_and_reference(model)
    trainer = make_trainer(policy, reference, tokenizer, pairs, tmp_path, desirable_weight=WD, undesirable_weight=WU)
    rows = with_kl_completions(unpaired(pairs[:3]))  # 6 rows: 3 desirable, 3 undesirable
    loss = trainer.compute_loss(policy, UnpairedCollator(tokenizer.pad_token_id)(rows))
    loss.backward()
    got = {n: p.grad.clone() for n, p in policy.named_parameters()}
    policy.zero_grad()

    def logratio(prompt, completion):
        with torch.no_grad():
            ref = sequence_logp(reference, prompt, completion)
        return sequence_logp(policy, prompt, completion) - ref

    kl = [logratio(r["prompt_ids"], r[KL_COMPLETION]).item() for r in rows]
    z0 = max(0.0, sum(kl) / len(kl))
    total = 0
    for r in rows:
        value = logratio(r["prompt_ids"], r["completion_ids"])
        if r["label"]:
            total = total + WD * (1 - torch.sigmoid(BETA * (value - z0)))
        else:
            total = total + WU * (1 - torch.sigmoid(BETA * (z0 - value)))
    want = total / len(rows)
    want.backward()
    assert loss.dtype == torch.float64 and z0 > 0
    assert loss.item() == pytest.approx(want.item(), abs=1e-6)
    for name, p in policy.named_parameters():
        assert torch.allclose(got[name], p.grad, atol=1e-6, rtol=0), name
    assert trainer.window_metrics["eval"]["kl"] == [pytest.approx(z0, abs=1e-6)]  # logged as float32


@pytest.mark.slow
def test_two_processes_give_one_process_reference_point_and_loss_when_one_estimate_is_negative(
    tiny_checkpoint, pairs, tmp_path
):
    """z₀ is the clamped mean of every process's KL rows: with the reference log-probs set so that
    the first process's KL log-ratios are (1.0, 0.6) and the second's (−0.4, −0.8), both processes
    use z₀ = max(0, 0.1) (not (0.8 + max(0, −0.6)) / 2), and their losses average to one
    process's, both against the formula."""
    from trainers.kto.data import KTO_VIEW, REF_KL_LOGPS, REF_LOGPS
    from trainers.models.pretrained import load_causal_lm
    from trainers.scoring.reference_pass import reference_logps

    model, tokenizer = load_causal_lm(tiny_checkpoint.path)
    rows = with_kl_completions(unpaired(pairs[:2]))  # desirable, undesirable, desirable, undesirable
    kl_targets, reward_targets = [1.0, 0.6, -0.4, -0.8], [0.5, -0.2, 0.3, -0.7]
    logps, kl_logps = reference_logps(
        model, tokenizer.pad_token_id, rows, 4, progress=False, completions=KTO_VIEW.completions
    )
    rows = [
        row | {REF_LOGPS: logp - r, REF_KL_LOGPS: kl_logp - k}
        for row, logp, kl_logp, r, k in zip(rows, logps, kl_logps, reward_targets, kl_targets)
    ]
    kto = {"beta": BETA, "desirable_weight": WD, "undesirable_weight": WU}
    spec = {"model": tiny_checkpoint.path, "rows": rows, "kto": kto}
    one, two = (launch_worker("kto_cpu", spec, n, tmp_path / str(n)) for n in (1, 2))

    z0 = max(0.0, sum(kl_targets) / 4)
    losses = [
        WD * (1 - sigmoid(BETA * (r - z0))) if row["label"] else WU * (1 - sigmoid(BETA * (z0 - r)))
        for row, r in zip(rows, reward_targets)
    ]
    assert z0 == pytest.approx(0.1)
    assert one[0]["kl"] == [pytest.approx(z0, abs=1e-5)]
    assert [rank["kl"] for rank in two] == [[pytest.approx(z0, abs=1e-5)]] * 2
    assert one[0]["loss"] == pytest.approx(sum(losses) / 4, abs=1e-6)
    assert [rank["loss"] for rank in two] == [
        pytest.approx(sum(losses[:2]) / 2, abs=1e-6),
        pytest.approx(sum(losses[2:]) / 2, abs=1e-6),
    ]
    assert (two[0]["loss"] + two[1]["loss"]) / 2 == pytest.approx(one[0]["loss"], abs=1e-6)


@pytest.mark.slow
def test_training_raises_desirable_rewards_over_undesirable_and_leaves_the_reference(tiny, pairs, tmp_path):
    model, tokenizer = tiny
    policy, reference = copy.deepcopy(model), copy.deepcopy(model)
    before = [p.detach().clone() for p in reference.parameters()]
    trainer = make_trainer(policy, reference, tokenizer, pairs, tmp_path, max_steps=8, logging_steps=4)
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logs) == 2
    assert {"kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "num_tokens"} <= set(logs[0])
    assert set(STAGES["kto"].curves) <= set(logs[0])  # what `alignflow compare` plots of KTO
    assert (
        logs[-1]["rewards/chosen"] - logs[-1]["rewards/rejected"]
        > logs[0]["rewards/chosen"] - logs[0]["rewards/rejected"]
    )
    assert logs[-1]["rewards/chosen"] > logs[-1]["rewards/rejected"]
    assert all(torch.equal(p, b) for p, b in zip(reference.parameters(), before))


@pytest.mark.unit
def test_kto_needs_unpaired_completions_or_preference_pairs(tmp_path):
    feedback = tmp_path / "feedback.jsonl"
    feedback.write_text('{"prompt": "1+1=", "completion": "2", "label": true}\n')
    config = load_config(None, ["stages=[kto]", "data.builtin=null", f"data.unpaired.path={feedback}"])
    assert config.data.unpaired.path == str(feedback)
    with pytest.raises(ValidationError, match="stage 'kto' needs data.unpaired or data.preference"):
        load_config(None, ["stages=[kto]", "data.builtin=null", f"data.sft.path={feedback}"])


@pytest.mark.slow
def test_the_stage_trains_on_the_unpaired_split_when_there_is_one(tiny_checkpoint, pairs, tmp_path):
    from trainers.catalog import STAGES, ModelSource, StageInputs

    labelled = [
        {"prompt_ids": p["prompt_ids"], "completion_ids": p["chosen_ids"], "label": i % 3 > 0}
        for i, p in enumerate(pairs)
    ]
    splits = {"preference": datasets.Dataset.from_list(list(pairs)), "unpaired": datasets.Dataset.from_list(labelled)}
    source = ModelSource(tiny_checkpoint.path)
    section = load_config(None, ["stages=[kto]", "kto.per_device_train_batch_size=4", "kto.reference=live"]).kto

    def build(splits):
        inputs = StageInputs(
            source, source, splits, str(tmp_path), dtype="float32", mixed_precision="no", cpu=True, padding_free="auto"
        )
        return STAGES["kto"].build(section, inputs)

    trainer = build(splits)
    assert trainer.train_dataset == with_kl_completions(labelled) and trainer.ref_model is not None
    batch = next(iter(trainer.get_train_dataloader()))
    assert batch["desirable"].shape == (4,) and batch["input_ids"].shape[0] == 8
    without = build({"preference": splits["preference"]})
    assert without.train_dataset == with_kl_completions(unpaired(pairs))  # the pairs, unpaired
    assert STAGES["kto"].needs_reference_logps(section) is False
    cached = load_config(None, ["stages=[kto]"]).kto
    assert STAGES["kto"].needs_reference_logps(cached) and STAGES["kto"].reference_view == "kto"
