import copy
import math
from pathlib import Path

import datasets
import pytest
import torch
from helpers import QUIET_TRAINING
from transformers import TrainerCallback

from trainers.data.collators import PreferenceCollator
from trainers.data.rows import Truncation, tokenize_split
from trainers.data.synthetic import AdditionTask, generate_addition
from trainers.dpo.losses import PREFERENCE_LOSSES
from trainers.dpo.section import DPOStageConfig
from trainers.dpo.trainer import DPOConfig, DPOTrainer, ld_token_weights, wpo_pair_weights
from trainers.scoring.reference_pass import reference_logps

pytestmark = pytest.mark.slow  # training: seconds a test


@pytest.fixture(scope="module")
def pairs(tiny_pairs):
    return tiny_pairs[:32]


def make_trainer(model, tokenizer, train_rows, tmp_path, ref_model=None, **overrides):
    reference = "live" if ref_model is not None else "cached"
    settings = dict(per_device_train_batch_size=8, learning_rate=1e-3, beta=0.5, reference=reference) | overrides
    args = DPOConfig(output_dir=str(tmp_path), **QUIET_TRAINING, **settings)
    return DPOTrainer(
        model=model,
        ref_model=ref_model,
        args=args,
        train_dataset=datasets.Dataset.from_list(train_rows),
        data_collator=PreferenceCollator(tokenizer.pad_token_id),
    )


def test_cached_reference_loss_equals_live_reference_loss(tiny, pairs, tmp_path):
    model, tokenizer = tiny
    policy, reference = copy.deepcopy(model), copy.deepcopy(model)
    with torch.no_grad():  # make policy differ from the reference so the log-ratios are not zero
        for p in policy.parameters():
            p.add_(0.01 * torch.randn_like(p))
    chosen, rejected = reference_logps(reference, tokenizer.pad_token_id, pairs, batch_size=16, progress=False)
    cached_rows = [dict(r, ref_chosen_logps=c, ref_rejected_logps=j) for r, c, j in zip(pairs, chosen, rejected)]

    collate = PreferenceCollator(tokenizer.pad_token_id)
    live = make_trainer(policy, tokenizer, pairs, tmp_path / "live", ref_model=reference)
    cached = make_trainer(policy, tokenizer, cached_rows, tmp_path / "cached")
    policy.eval()
    loss_live = live.compute_loss(policy, collate(pairs[:8]))
    loss_cached = cached.compute_loss(policy, collate(cached_rows[:8]))
    assert loss_live.item() > 0
    assert abs(loss_live.item() - loss_cached.item()) <= 1e-5


class RecordLogs(TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def test_dpo_training_raises_reward_accuracy_and_leaves_reference_unchanged(tiny, pairs, tmp_path):
    model, tokenizer = tiny
    policy, reference = copy.deepcopy(model), copy.deepcopy(model)
    before = {name: p.detach().clone() for name, p in reference.named_parameters()}
    policy_before = {name: p.detach().clone() for name, p in policy.named_parameters()}
    recorder = RecordLogs()
    trainer = make_trainer(policy, tokenizer, pairs, tmp_path, ref_model=reference, num_train_epochs=8, logging_steps=4)
    trainer.add_callback(recorder)
    trainer.train()

    accuracies = [
        log["rewards/accuracies"] for log in recorder.logs if "rewards/accuracies" in log and "train_loss" not in log
    ]
    assert len(accuracies) >= 4
    assert accuracies[-1] > accuracies[0]
    assert accuracies[-1] >= 0.9
    for name, p in reference.named_parameters():
        assert torch.equal(p, before[name]), f"reference parameter {name} changed"
    assert any(not torch.equal(p, policy_before[n]) for n, p in policy.named_parameters())
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
        assert key in recorder.logs[0]


def with_cached_reference(model, tokenizer, rows):
    """Rows with ``ref_*`` columns: the model's own log-probs shifted, so log-ratios are not zero."""
    chosen, rejected = reference_logps(model, tokenizer.pad_token_id, rows, batch_size=16, progress=False)
    return [
        dict(r, ref_chosen_logps=c + 0.3 * (i % 3 - 1), ref_rejected_logps=j + 0.2)
        for i, (r, c, j) in enumerate(zip(rows, chosen, rejected))
    ]


@pytest.mark.parametrize(
    "losses",
    [
        {"loss_type": "sigmoid"},
        {"loss_type": ["ipo", "sft"], "loss_weights": [1.0, 0.5]},
        {"loss_type": ["f_divergence", "orpo"], "f_divergence_type": "js_divergence", "use_weighting": True},
        {"loss_type": "simpo", "ld_alpha": 0.5, "use_weighting": True},
    ],
    ids=["sigmoid", "ipo+sft", "f_divergence+orpo-wpo", "simpo-ld-wpo"],
)
def test_gradient_accumulation_matches_one_large_batch(tiny, pairs, tmp_path, losses):
    """2 micro-batches x 2 accumulation steps make the same SGD update as one batch of 4."""
    model, tokenizer = tiny
    rows = with_cached_reference(model, tokenizer, pairs[:4])
    # Plain SGD with lr=1 and no clipping: the update is exactly minus the accumulated gradient.
    sgd = dict(max_steps=1, optim="sgd", learning_rate=1.0, lr_scheduler_type="constant", max_grad_norm=1e9)

    def update(batch_size, accumulation, folder):
        policy = copy.deepcopy(model)
        start = [p.detach().clone() for p in policy.parameters()]
        make_trainer(
            policy,
            tokenizer,
            rows,
            tmp_path / folder,
            per_device_train_batch_size=batch_size,
            gradient_accumulation_steps=accumulation,
            **sgd,
            **losses,
        ).train()
        return [p.detach() - s for p, s in zip(policy.parameters(), start)]

    one_batch, accumulated = update(4, 1, "big"), update(2, 2, "small")
    assert any(d.abs().max() > 1e-4 for d in one_batch)
    for a, b in zip(one_batch, accumulated):
        assert torch.allclose(a, b, atol=1e-5)


LOSS_RUNS = {name: {"loss_type": name} for name in sorted(PREFERENCE_LOSSES)} | {
    "robust-smoothed": {"loss_type": "robust", "label_smoothing": 0.1},
    "sigmoid+sft": {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]},
    "simpo+sft": {"loss_type": ["simpo", "sft"], "loss_weights": [1.0, 0.5]},
    "f_divergence-forward_kl": {"loss_type": "f_divergence", "f_divergence_type": "forward_kl"},
    "f_divergence-js_divergence": {"loss_type": "f_divergence", "f_divergence_type": "js_divergence"},
    "f_divergence-alpha_divergence": {"loss_type": "f_divergence", "f_divergence_type": "alpha_divergence"},
    "sigmoid-wpo": {"loss_type": "sigmoid", "use_weighting": True},
    "sigmoid-ld": {"loss_type": "sigmoid", "ld_alpha": 0.5},
    "simpo-wpo-ld": {"loss_type": "simpo", "use_weighting": True, "ld_alpha": 0.5},
}


@pytest.mark.parametrize("name", sorted(LOSS_RUNS))
def test_short_run_changes_every_parameter_and_leaves_the_live_reference_unchanged(tiny, pairs, tmp_path, name):
    """Every objective trains; one that needs a reference gets a live one and leaves it unchanged, a
    reference-free one runs under the default ``reference: cached`` with no reference model and
    no ``ref_*`` columns in its rows: it reads no reference at all."""
    model, tokenizer = tiny
    policy, reference = copy.deepcopy(model), copy.deepcopy(model)
    policy_before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    reference_before = {n: p.detach().clone() for n, p in reference.named_parameters()}
    needs_reference = DPOStageConfig(**LOSS_RUNS[name]).objective().needs_reference
    trainer = make_trainer(
        policy,
        tokenizer,
        pairs[:4],
        tmp_path,
        ref_model=reference if needs_reference else None,
        max_steps=1,
        per_device_train_batch_size=4,
        **LOSS_RUNS[name],
    )
    assert trainer.reference_mode == ("live" if needs_reference else "none")
    trainer.train()
    assert [n for n, p in policy.named_parameters() if torch.equal(p, policy_before[n])] == []
    assert [n for n, p in reference.named_parameters() if not torch.equal(p, reference_before[n])] == []


def naive_row_scores(model, prompt_ids, completion_ids):
    """(summed completion log-prob, summed vocabulary-mean logit, completion tokens) of one
    unpadded sequence, with a plain log_softmax."""
    with torch.no_grad():
        sequence = torch.tensor([prompt_ids + completion_ids])
        logits = model(sequence).logits[0].double()
    positions = range(len(prompt_ids) - 1, len(prompt_ids) + len(completion_ids) - 1)
    logp = sum(torch.log_softmax(logits[p], -1)[sequence[0, p + 1]].item() for p in positions)
    return logp, sum(logits[p].mean().item() for p in positions), len(completion_ids)


def expected_batch_metrics(model, rows, beta, sft_weight=None):
    """DPO metrics of one batch, from per-row naive log-probs and the cached reference columns."""
    chosen = [naive_row_scores(model, r["prompt_ids"], r["chosen_ids"]) for r in rows]
    rejected = [naive_row_scores(model, r["prompt_ids"], r["rejected_ids"]) for r in rows]
    reward_c = [beta * (c[0] - r["ref_chosen_logps"]) for c, r in zip(chosen, rows)]
    reward_r = [beta * (j[0] - r["ref_rejected_logps"]) for j, r in zip(rejected, rows)]
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    sigmoid = mean([math.log1p(math.exp(-(c - j))) for c, j in zip(reward_c, reward_r)])
    metrics = {
        "rewards/chosen": mean(reward_c),
        "rewards/rejected": mean(reward_r),
        "rewards/accuracies": mean([float(c > j) for c, j in zip(reward_c, reward_r)]),
        "rewards/margins": mean([c - j for c, j in zip(reward_c, reward_r)]),
        "logps/chosen": mean([c[0] for c in chosen]),
        "logps/rejected": mean([j[0] for j in rejected]),
        "logits/chosen": sum(c[1] for c in chosen) / sum(c[2] for c in chosen),
        "logits/rejected": sum(j[1] for j in rejected) / sum(j[2] for j in rejected),
        "num_tokens": sum(2 * len(r["prompt_ids"]) + len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in rows),
        "loss": sigmoid,
    }
    if sft_weight is not None:
        sft = mean([-c[0] / c[2] for c in chosen])
        metrics |= {"loss/sigmoid": sigmoid, "loss/sft": sft, "loss": sigmoid + sft_weight * sft}
    return metrics


def window_of(batches: list[dict]) -> dict:
    """Window aggregation: ``num_tokens`` summed over the batches, everything else averaged."""
    return {name: sum(b[name] for b in batches) / (1 if name == "num_tokens" else len(batches)) for name in batches[0]}


def test_train_logs_average_the_window_of_batches(tiny, pairs, tmp_path):
    model, tokenizer = tiny
    rows = with_cached_reference(model, tokenizer, pairs[:8])
    recorder = RecordLogs()
    # Learning rate 0 keeps the policy fixed, and a sequential sampler fixes the batches, so the
    # expected metrics of the two batches of the window can be computed here.
    trainer = make_trainer(
        copy.deepcopy(model),
        tokenizer,
        rows,
        tmp_path,
        per_device_train_batch_size=4,
        max_steps=2,
        logging_steps=2,
        optim="sgd",
        learning_rate=0.0,
        train_sampling_strategy="sequential",
    )
    trainer.add_callback(recorder)
    trainer.train()
    (log,) = [log for log in recorder.logs if "rewards/chosen" in log]
    want = window_of([expected_batch_metrics(model, rows[:4], 0.5), expected_batch_metrics(model, rows[4:], 0.5)])
    assert want["rewards/accuracies"] not in (0.0, 1.0)
    for name, value in want.items():
        assert log[name] == pytest.approx(value, abs=1e-5), name


def test_evaluate_reads_cached_eval_reference_and_returns_eval_metrics(tiny, pairs, tmp_path):
    model, tokenizer = tiny
    train_rows, eval_rows = pairs[:8], with_cached_reference(model, tokenizer, pairs[8:16])
    trainer = make_trainer(
        copy.deepcopy(model),
        tokenizer,
        train_rows,
        tmp_path,
        per_device_eval_batch_size=4,
        loss_type=["sigmoid", "sft"],
        loss_weights=[1.0, 0.25],
    )
    trainer.eval_dataset = datasets.Dataset.from_list(eval_rows)
    metrics = trainer.evaluate()
    want = window_of(
        [
            expected_batch_metrics(model, eval_rows[:4], 0.5, 0.25),
            expected_batch_metrics(model, eval_rows[4:], 0.5, 0.25),
        ]
    )
    for name, value in want.items():
        assert metrics[f"eval_{name}"] == pytest.approx(value, abs=1e-5), name
    assert not any(key.startswith("rewards/") for key in metrics)


def test_reference_free_takes_reference_logps_as_zero(tiny, pairs, tmp_path):
    model, tokenizer = tiny
    trainer = make_trainer(model, tokenizer, pairs[:4], tmp_path, reference="none")
    model.eval()
    loss = trainer.compute_loss(model, PreferenceCollator(tokenizer.pad_token_id)(pairs[:4]))
    margins = [
        naive_row_scores(model, r["prompt_ids"], r["chosen_ids"])[0]
        - naive_row_scores(model, r["prompt_ids"], r["rejected_ids"])[0]
        for r in pairs[:4]
    ]
    assert loss.item() == pytest.approx(sum(math.log1p(math.exp(-0.5 * m)) for m in margins) / 4, abs=1e-5)
    with pytest.raises(ValueError, match="reference='none': pass a ref_model exactly when reference='live'"):
        make_trainer(model, tokenizer, pairs[:4], tmp_path, ref_model=copy.deepcopy(model), reference="none")


def test_periodic_sync_mixes_the_policy_into_the_live_reference(tiny, pairs, tmp_path):
    model, tokenizer = tiny
    policy, reference = copy.deepcopy(model), copy.deepcopy(model)
    with torch.no_grad():  # a reference that differs from the policy, so the mix is visible
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    reference_before = {n: p.detach().clone() for n, p in reference.named_parameters()}
    make_trainer(
        policy,
        tokenizer,
        pairs[:8],
        tmp_path,
        ref_model=reference,
        max_steps=2,
        per_device_train_batch_size=4,
        sync_ref_model=True,
        ref_model_mixup_alpha=0.25,
        ref_model_sync_steps=2,
    ).train()
    policy_params = dict(policy.named_parameters())
    for name, p in reference.named_parameters():  # one sync, after step 2
        expected = 0.25 * policy_params[name].detach() + 0.75 * reference_before[name]
        assert torch.allclose(p, expected, atol=1e-6), name
    assert not torch.equal(reference.model.norm.weight, reference_before["model.norm.weight"])


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"loss_type": "nope"}, "unknown loss_type 'nope'"),
        ({"loss_type": ["sigmoid", "hinge"], "loss_weights": [1.0]}, "1 weights for 2 losses"),
        ({"loss_type": "hinge", "label_smoothing": 0.2}, "has no effect"),
        ({"beta": 0.0}, "greater than 0"),
        ({"sync_ref_model": True, "reference": "none"}, "sync_ref_model needs reference: live"),
    ],
)
def test_invalid_dpo_section_fails_before_any_arguments_exist(tmp_path, settings, message):
    with pytest.raises(ValueError, match=message):
        DPOStageConfig(**settings).training_arguments(DPOConfig, output_dir=str(tmp_path))


def test_a_cached_reference_trainer_refuses_a_reference_model_and_missing_columns(tiny, pairs, tmp_path):
    model, tokenizer = tiny
    with pytest.raises(ValueError, match="reference='cached': pass a ref_model exactly when reference='live'"):
        make_trainer(model, tokenizer, pairs[:4], tmp_path, ref_model=copy.deepcopy(model), reference="cached")
    trainer = make_trainer(model, tokenizer, pairs[:4], tmp_path)
    with pytest.raises(ValueError, match="reference='cached' needs the columns"):
        trainer.compute_loss(model, PreferenceCollator(tokenizer.pad_token_id)(pairs[:4]))


def uneven_rows(model, tokenizer, pairs):
    """Pairs whose chosen and rejected completions differ in length, both ways, with cached
    reference columns (:func:`with_cached_reference`)."""
    rows = []
    for i, r in enumerate(pairs[:4]):
        longer = r["chosen_ids"] + r["rejected_ids"] + r["chosen_ids"][: i + 1]
        chosen, rejected = (longer, r["rejected_ids"]) if i % 2 == 0 else (r["chosen_ids"], longer)
        rows.append(dict(r, chosen_ids=chosen, rejected_ids=rejected))
    return with_cached_reference(model, tokenizer, rows)


def naive_token_terms(model, prompt_ids, completion_ids):
    """Per completion token, with plain float64 ops on one unpadded sequence: log p(y_t) (with
    gradient) and log p(y_t) − log Σ_v p_v² (without)."""
    sequence = torch.tensor([prompt_ids + completion_ids])
    logits = model(sequence).logits[0].double()
    logps, wpo = [], []
    for position in range(len(prompt_ids) - 1, len(prompt_ids) + len(completion_ids) - 1):
        log_probs = torch.log_softmax(logits[position], -1)
        logp = log_probs[sequence[0, position + 1]]
        logps.append(logp)
        wpo.append(logp.item() - math.log(sum(p * p for p in log_probs.detach().exp().tolist())))
    return logps, wpo


def naive_option_loss(model, rows, beta, ld_alpha, use_weighting, sft=False):
    """The sigmoid loss with LD-DPO and WPO written out per pair from :func:`naive_token_terms`, plus
    (``sft``) RPO's NLL of the chosen completion, −Σ_t log π(y_t)/|y_c|, on the true log-probs."""
    total = 0
    for r in rows:
        chosen, chosen_wpo = naive_token_terms(model, r["prompt_ids"], r["chosen_ids"])
        rejected, rejected_wpo = naive_token_terms(model, r["prompt_ids"], r["rejected_ids"])
        public = min(len(chosen), len(rejected))  # l_p: tokens beyond it are scaled by α
        alpha = 1.0 if ld_alpha is None else ld_alpha
        chosen_ld, rejected_ld = (sum(x[:public]) + alpha * sum(x[public:]) for x in (chosen, rejected))
        margin = (chosen_ld - r["ref_chosen_logps"]) - (rejected_ld - r["ref_rejected_logps"])
        weight = 1.0
        if use_weighting:
            weight = min(1.0, math.exp(sum(chosen_wpo) / len(chosen) + sum(rejected_wpo) / len(rejected)))
        total = total - weight * torch.nn.functional.logsigmoid(beta * margin)
        if sft:
            total = total - weight * sum(chosen) / len(chosen)
    return total / len(rows)


@pytest.mark.parametrize(
    "options",
    [
        {"ld_alpha": 0.3},
        {"use_weighting": True},
        {"ld_alpha": 0.6, "use_weighting": True},
        {"ld_alpha": 0.3, "loss_type": ["sigmoid", "sft"]},
    ],
    ids=["ld", "wpo", "ld+wpo", "ld+rpo"],
)
def test_ld_alpha_and_wpo_weighting_match_the_per_token_formula_in_float64(tiny, pairs, tmp_path, options):
    """Loss and every parameter's gradient equal the per-token formulas, written here with plain
    log_softmax per sequence in float64; WPO weights carry no gradient; the reference columns are
    read as cached (LD-DPO scales the policy's log-probs only)."""
    model, tokenizer = tiny
    rows = uneven_rows(model, tokenizer, pairs)
    policy = copy.deepcopy(model).double().eval()
    trainer = make_trainer(policy, tokenizer, rows, tmp_path, **options)
    loss = trainer.compute_loss(policy, PreferenceCollator(tokenizer.pad_token_id)(rows))
    loss.backward()
    got = {n: p.grad.clone() for n, p in policy.named_parameters()}
    policy.zero_grad()
    sft = "sft" in options.get("loss_type", [])  # ld_alpha stays out of RPO's NLL term
    want = naive_option_loss(policy, rows, 0.5, options.get("ld_alpha"), options.get("use_weighting", False), sft)
    want.backward()
    assert loss.dtype == torch.float64
    assert loss.item() == pytest.approx(want.item(), abs=1e-6)
    for name, p in policy.named_parameters():
        assert torch.allclose(got[name], p.grad, atol=1e-6, rtol=0), name
    without = {key: value for key, value in options.items() if key == "loss_type"}
    plain = make_trainer(policy, tokenizer, rows, tmp_path, **without).compute_loss(
        policy, PreferenceCollator(tokenizer.pad_token_id)(rows)
    )
    assert abs(plain.item() - loss.item()) > 1e-3  # the option does something on these pairs
    if options.get("use_weighting"):
        weights = trainer.window_metrics["eval"]["wpo/weights"]  # the policy is in eval mode
        assert weights and 0.1 < weights[-1] < 0.99  # some pairs below 1, some clamped at 1


def test_ld_token_weights_split_each_pair_at_its_shorter_completion():
    # rows: chosen 0, chosen 1, rejected 0, rejected 1; completion tokens marked 1
    completion_mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 0, 0], [0, 1, 1, 0, 0], [0, 0, 1, 1, 1]])
    a = 0.25
    want = torch.tensor(
        [[1, 1, 1, a, 1], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, a, a]],
        dtype=torch.float32,
    )
    assert torch.equal(ld_token_weights(completion_mask, a), want)


def test_wpo_pair_weights_are_clamped_products():
    chosen, rejected = torch.tensor([-0.5, 0.4, 0.1]), torch.tensor([-0.25, -0.1, 0.2])
    want = [min(1.0, math.exp(c + r)) for c, r in zip(chosen.tolist(), rejected.tolist())]
    assert wpo_pair_weights(chosen, rejected).tolist() == pytest.approx(want, abs=1e-7)


def test_reference_free_objective_reads_no_reference_and_refuses_a_live_one(tiny, pairs, tmp_path):
    """simpo under the default reference: cached needs no ref_* columns (the reference log-probs
    are never read), and a live reference model is an error in the section and in the trainer."""
    model, tokenizer = tiny
    trainer = make_trainer(model, tokenizer, pairs[:4], tmp_path, loss_type="simpo", beta=2.0)
    assert (trainer.args.reference, trainer.reference_mode) == ("cached", "none")
    model.eval()
    loss = trainer.compute_loss(model, PreferenceCollator(tokenizer.pad_token_id)(pairs[:4]))
    scores = [
        (
            naive_row_scores(model, r["prompt_ids"], r["chosen_ids"]),
            naive_row_scores(model, r["prompt_ids"], r["rejected_ids"]),
        )
        for r in pairs[:4]
    ]
    z = [2.0 * (c[0] / c[2] - j[0] / j[2]) - 0.5 for c, j in scores]
    assert loss.item() == pytest.approx(sum(math.log1p(math.exp(-v)) for v in z) / 4, abs=1e-5)
    with pytest.raises(ValueError, match="reference: live loads a reference model that \\['simpo'\\] never reads"):
        make_trainer(model, tokenizer, pairs[:4], tmp_path, ref_model=copy.deepcopy(model), loss_type="simpo")
    with pytest.raises(ValueError, match="reference: live loads a reference model"):
        DPOStageConfig(loss_type=["orpo", "sft"], reference="live")


def chosen_logps_over_training(model, tokenizer, rows, tmp_path, **objective) -> tuple[float, list[float], float]:
    """The mean chosen log-prob of ``rows`` before training, at every log, and the final margin."""
    start, _ = reference_logps(model, tokenizer.pad_token_id, rows, batch_size=64, progress=False)
    recorder = RecordLogs()
    settings = dict(learning_rate=5e-3, num_train_epochs=8, logging_steps=4, lr_scheduler_type="constant", seed=0)
    trainer = make_trainer(
        copy.deepcopy(model),
        tokenizer,
        with_zero_reference(model, tokenizer, rows),
        tmp_path,
        per_device_train_batch_size=16,
        **settings,
        **objective,
    )
    trainer.add_callback(recorder)
    trainer.train()
    steps = [log for log in recorder.logs if "logps/chosen" in log and "train_loss" not in log]
    return sum(start) / len(start), [log["logps/chosen"] for log in steps], steps[-1]["rewards/margins"]


def with_zero_reference(model, tokenizer, rows):
    """The model's own log-probs as the cached reference (the policy starts as its reference)."""
    chosen, rejected = reference_logps(model, tokenizer.pad_token_id, rows, batch_size=64, progress=False)
    return [dict(r, ref_chosen_logps=c, ref_rejected_logps=j) for r, c, j in zip(rows, chosen, rejected)]


def test_the_default_objective_keeps_the_chosen_log_prob_from_falling_where_sigmoid_alone_lets_it(tiny, tmp_path):
    """Likelihood displacement: the sigmoid loss only widens the margin, and on pairs that share
    most tokens (answers off by 1, 2 or 10) it also pulls the chosen completion down (at lr 5e-3
    on 64 pairs: 4+ nats below its start mid-run). The default experiment's DPO objective adds
    RPO's NLL term on the chosen completion: the chosen log-prob only rises, the margin still grows."""
    from infra.core.config import load_config

    model, tokenizer = tiny
    rows = generate_addition(AdditionTask(max_operand=9, num_eval_problems=20))["preference"]
    rows = tokenize_split(rows, "preference", tokenizer, Truncation(32, 16))[0][:64]
    dpo = load_config(Path(__file__).parents[1] / "configs" / "default.yaml").dpo
    assert "sigmoid" in dpo.loss_type and "sft" in dpo.loss_type

    start, sigmoid_alone, _ = chosen_logps_over_training(model, tokenizer, rows, tmp_path / "a", loss_type="sigmoid")
    assert min(sigmoid_alone) < start - 1.0

    default = dict(loss_type=dpo.loss_type, loss_weights=dpo.loss_weights)
    start, with_nll, margin = chosen_logps_over_training(model, tokenizer, rows, tmp_path / "b", **default)
    assert min(with_nll) > start
    assert with_nll[-1] > start + 4.0
    assert margin > 0.3
