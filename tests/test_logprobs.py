import os
import subprocess
import sys
import textwrap
from unittest.mock import patch

import pytest
import torch

from trainers.collators import PreferenceCollator, prompt_completion_batch
from trainers.logprobs import TargetLogProbs, completion_logps


def naive_token_logps(logits, targets):
    return torch.log_softmax(logits.float(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_target_logprobs_equal_log_softmax_gather_values_and_gradients(dtype):
    torch.manual_seed(0)
    logits = (4 * torch.randn(3, 9, 301)).to(dtype).requires_grad_()
    targets = torch.randint(0, 301, (3, 9))
    mask = torch.rand(3, 9) < 0.6
    rows, cols = mask.nonzero(as_tuple=True)
    weights = torch.randn(rows.numel())

    got, means = TargetLogProbs.apply(logits, rows, cols, targets[rows, cols], 5)  # chunks of 5 positions
    (got * weights).sum().backward()
    got_grad, logits.grad = logits.grad, None
    want = naive_token_logps(logits, targets)[rows, cols]
    (want * weights).sum().backward()

    assert got.dtype == torch.float32
    assert torch.allclose(got, want, atol=1e-5, rtol=0)
    assert torch.allclose(means, logits.float().mean(-1)[rows, cols], atol=1e-5)
    assert got_grad.dtype == dtype
    assert torch.allclose(got_grad.float(), logits.grad.float(), atol=1e-6, rtol=0)
    assert got_grad[~mask].abs().max() == 0  # unscored positions get no gradient


def test_target_logprobs_backward_passes_gradcheck_in_float64():
    torch.manual_seed(1)
    logits = torch.randn(2, 5, 7, dtype=torch.float64, requires_grad=True)
    rows, cols, targets = torch.tensor([0, 0, 1]), torch.tensor([1, 3, 4]), torch.tensor([2, 6, 0])
    assert torch.autograd.gradcheck(lambda x: TargetLogProbs.apply(x, rows, cols, targets, 2)[0], (logits,))


class LogitsToKeepSpy(torch.nn.Module):
    """A causal LM wrapper that records the ``logits_to_keep`` it is asked for."""

    def __init__(self, model):
        super().__init__()
        self.model, self.requested = model, []

    def forward(self, input_ids, attention_mask=None, use_cache=False, logits_to_keep=0):
        self.requested.append(logits_to_keep)
        return self.model(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=use_cache, logits_to_keep=logits_to_keep
        )


class FullLogitsOnly(torch.nn.Module):
    """A causal LM whose ``forward`` does not accept ``logits_to_keep``."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=use_cache)


def test_completion_logps_equals_naive_sum_over_completion_tokens(tiny):
    model, tokenizer = tiny
    pad = tokenizer.pad_token_id
    prompts = [[10, 11, 12, 14], [13, 15]]
    completions = [[20, 21], [22, 23, 24, 25, 2]]
    batch = prompt_completion_batch(prompts, completions, pad)
    assert batch["input_ids"].tolist() == [[10, 11, 12, 14, 20, 21, pad], [13, 15, 22, 23, 24, 25, 2]]
    assert batch["completion_mask"].tolist() == [[0, 0, 0, 0, 1, 1, 0], [0, 0, 1, 1, 1, 1, 1]]

    spy, plain = LogitsToKeepSpy(model), FullLogitsOnly(model)
    got = completion_logps(spy, batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
    # The earliest completion token is at index 2, predicted from position 1: keep positions 1..6.
    assert spy.requested == [6]
    fallback = completion_logps(plain, batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
    assert got.num_tokens.tolist() == [2.0, 5.0]
    with torch.no_grad():
        for row, (prompt, completion) in enumerate(zip(prompts, completions)):
            sequence = torch.tensor([prompt + completion])  # unpadded, alone: nothing else can leak in
            logits = model(sequence).logits[0]
            positions = range(len(prompt) - 1, len(prompt) + len(completion) - 1)
            expected = sum(torch.log_softmax(logits[p], -1)[sequence[0, p + 1]] for p in positions)
            mean_logits = sum(logits[p].mean() for p in positions)
            assert abs(got.logps[row].item() - expected.item()) <= 1e-5
            assert abs(fallback.logps[row].item() - expected.item()) <= 1e-5
            assert abs(got.logit_sums[row].item() - mean_logits.item()) <= 1e-5


def test_completion_logps_options_weight_tokens_and_give_wpo_terms_and_are_off_by_default(tiny):
    """``token_weights`` of ones is bit-identical to none; other weights scale each token's
    log-prob; ``wpo_terms`` gives, per row, the mean of log p(y_t) − log Σ_v p_v² (chunked like the
    log-probs; here one position per chunk), without gradient."""
    model, tokenizer = tiny
    prompts, completions = [[10, 11, 12, 14], [13, 15]], [[20, 21], [22, 23, 24, 25, 2]]
    batch = prompt_completion_batch(prompts, completions, tokenizer.pad_token_id)
    ids, attention, mask = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    plain = completion_logps(model, ids, attention, mask)
    assert plain.wpo_logweights is None
    ones = completion_logps(model, ids, attention, mask, token_weights=torch.ones(ids.shape))
    assert torch.equal(ones.logps, plain.logps)
    weights = torch.rand(ids.shape, dtype=torch.float64)
    with patch("trainers.logprobs.CHUNK_ELEMENTS", 1):
        got = completion_logps(model, ids, attention, mask, token_weights=weights, wpo_terms=True)
    assert got.wpo_logweights.requires_grad is False and got.logps.requires_grad
    with torch.no_grad():
        for row, (prompt, completion) in enumerate(zip(prompts, completions)):
            sequence = torch.tensor([prompt + completion])
            log_probs = torch.log_softmax(model(sequence).logits[0].double(), -1)
            positions = range(len(prompt) - 1, len(prompt) + len(completion) - 1)
            token = [log_probs[p, sequence[0, p + 1]].item() for p in positions]
            collision = [torch.logsumexp(2 * log_probs[p], -1).item() for p in positions]
            # position p predicts token p + 1, whose weight is weights[row, p + 1]
            weighted = sum(weights[row, p + 1].item() * t for p, t in zip(positions, token))
            assert abs(got.logps[row].item() - weighted) <= 1e-5
            wpo = sum(t - c for t, c in zip(token, collision)) / len(completion)
            assert abs(got.wpo_logweights[row].item() - wpo) <= 1e-5


def test_completion_logps_gradient_equals_naive_gradient(tiny):
    model, tokenizer = tiny
    batch = prompt_completion_batch([[10, 11, 12], [13]], [[20, 21], [22, 23, 24, 2]], tokenizer.pad_token_id)

    def gradients(logps_fn):
        model.zero_grad()
        logps_fn().sum().backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    def naive():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        token = naive_token_logps(logits, batch["input_ids"][:, 1:])
        return (token * batch["completion_mask"][:, 1:]).sum(-1)

    ours = gradients(
        lambda: completion_logps(model, batch["input_ids"], batch["attention_mask"], batch["completion_mask"]).logps
    )
    reference = gradients(naive)
    model.zero_grad()
    for name in reference:
        assert torch.allclose(ours[name], reference[name], atol=1e-5), name


def test_preference_collator_stacks_chosen_then_rejected(tiny):
    _, tokenizer = tiny
    pad = tokenizer.pad_token_id
    features = [
        {
            "prompt_ids": [5, 6],
            "chosen_ids": [7, 2],
            "rejected_ids": [8, 9, 2],
            "ref_chosen_logps": -1.0,
            "ref_rejected_logps": -2.0,
        },
        {
            "prompt_ids": [5],
            "chosen_ids": [7, 7, 2],
            "rejected_ids": [2],
            "ref_chosen_logps": -3.0,
            "ref_rejected_logps": -4.0,
        },
    ]
    batch = PreferenceCollator(pad)(features)
    assert batch["input_ids"].tolist() == [
        [5, 6, 7, 2, pad],
        [5, 7, 7, 2, pad],
        [5, 6, 8, 9, 2],
        [5, 2, pad, pad, pad],
    ]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert batch["completion_mask"].tolist() == [[0, 0, 1, 1, 0], [0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [0, 1, 0, 0, 0]]
    assert batch["ref_chosen_logps"].tolist() == [-1.0, -3.0]
    assert batch["ref_rejected_logps"].tolist() == [-2.0, -4.0]


# Peak memory: each form runs in a fresh interpreter. After the logits exist, the kernel's
# peak-RSS mark is reset to the current RSS (/proc/self/clear_refs); the figure is the peak
# (VmHWM) reached during the log-prob computation, forward and backward, minus that RSS.
# (ru_maxrss would not do: a child starts with its parent's peak.) glibc's mmap threshold is
# pinned at 128 KiB so that every freed tensor buffer goes back to the OS; by default the
# threshold grows after frees and freed chunks stay resident, inflating RSS.
PEAK_SCRIPT = textwrap.dedent(
    """
    import re, sys, torch
    from trainers.logprobs import CHUNK_ELEMENTS, TargetLogProbs

    def kib(field):
        return int(re.search(field + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))

    torch.manual_seed(0)
    rows, positions, vocab = 4, 128, 32768
    logits = torch.randn(rows, positions, vocab, dtype=torch.bfloat16).requires_grad_()
    targets = torch.randint(0, vocab, (rows, positions))
    r, c = torch.ones(rows, positions, dtype=torch.bool).nonzero(as_tuple=True)
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")
    before = kib("VmRSS")
    if sys.argv[1] == "naive":
        logps = torch.log_softmax(logits.float(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1).sum()
    else:
        logps = TargetLogProbs.apply(logits, r, c, targets[r, c], CHUNK_ELEMENTS // vocab)[0].sum()
    logps.backward()
    print(kib("VmHWM") - before)
    """
)


def peak_growth_mib(form: str) -> float:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, form], capture_output=True, text=True, check=True, timeout=300, env=env
    )
    return int(result.stdout.strip()) / 1024


def test_peak_memory_is_below_the_naive_form_on_a_large_vocabulary():
    """bf16 logits of 4 × 128 × 32768 (32 MiB; a float32 copy is 64 MiB), forward and backward.

    Measured here: naive ≈ 196 MiB (float32 copy + float32 log_softmax + their gradients), ours ≈
    95 MiB (the bf16 gradient of the logits, needed by both, plus float32 chunk temporaries).
    """
    naive, ours = peak_growth_mib("naive"), peak_growth_mib("ours")
    float32_copy = 4 * 128 * 32768 * 4 / 2**20
    assert naive > 2 * float32_copy, naive
    assert naive - ours > float32_copy, (naive, ours)  # at least one full float32 logits copy less
