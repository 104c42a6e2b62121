import copy

import datasets
import pytest
import torch
from transformers import TrainerCallback

from trainers.collators import PreferenceCollator
from trainers.data import Truncation, tokenize_split
from trainers.dpo import DPOConfig, DPOTrainer
from trainers.reference import reference_logps
from trainers.synthetic import AdditionTask, generate_addition


@pytest.fixture(scope="module")
def pairs(tiny):
    _, tokenizer = tiny
    rows = generate_addition(AdditionTask(max_operand=9, num_eval_problems=20))["preference"]
    tokenized, dropped = tokenize_split(rows, "preference", tokenizer, Truncation(32, 16))
    assert dropped == 0
    return tokenized[:32]


def make_trainer(model, tokenizer, train_rows, tmp_path, ref_model=None, **overrides):
    settings = dict(per_device_train_batch_size=8, learning_rate=1e-3, beta=0.5) | overrides
    args = DPOConfig(
        output_dir=str(tmp_path), report_to=[], save_strategy="no", disable_tqdm=True, dataloader_pin_memory=False, **settings
    )
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

    accuracies = [log["rewards/accuracies"] for log in recorder.logs if "rewards/accuracies" in log and "train_loss" not in log]
    assert len(accuracies) >= 4
    assert accuracies[-1] > accuracies[0]
    assert accuracies[-1] >= 0.9
    for name, p in reference.named_parameters():
        assert torch.equal(p, before[name]), f"reference parameter {name} changed"
    assert any(not torch.equal(p, policy_before[n]) for n, p in policy.named_parameters())
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
        assert key in recorder.logs[0]


def test_gradient_accumulation_matches_one_large_batch(tiny, pairs, tmp_path):
    """2 micro-batches x 2 accumulation steps make the same SGD update as one batch of 4."""
    model, tokenizer = tiny
    chosen, rejected = reference_logps(model, tokenizer.pad_token_id, pairs[:4], batch_size=4, progress=False)
    rows = [dict(r, ref_chosen_logps=c - 0.3, ref_rejected_logps=j + 0.2) for r, c, j in zip(pairs[:4], chosen, rejected)]
    # Plain SGD with lr=1 and no clipping: the update is exactly minus the accumulated gradient.
    sgd = dict(max_steps=1, optim="sgd", learning_rate=1.0, lr_scheduler_type="constant", max_grad_norm=1e9)

    def update(batch_size, accumulation, folder):
        policy = copy.deepcopy(model)
        start = [p.detach().clone() for p in policy.parameters()]
        make_trainer(policy, tokenizer, rows, tmp_path / folder, per_device_train_batch_size=batch_size,
                     gradient_accumulation_steps=accumulation, **sgd).train()
        return [p.detach() - s for p, s in zip(policy.parameters(), start)]

    one_batch, accumulated = update(4, 1, "big"), update(2, 2, "small")
    assert any(d.abs().max() > 1e-4 for d in one_batch)
    for a, b in zip(one_batch, accumulated):
        assert torch.allclose(a, b, atol=1e-5)
