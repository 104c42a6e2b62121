import os
import subprocess
import sys
import textwrap
from unittest.mock import patch

import pytest
import torch

from trainers.data.collators import PreferenceCollator, prompt_completion_batch
from trainers.scoring.logprobs import TargetLogProbs, completion_logps, next_token_logps, plan_chunks


def naive_token_logps(logits, targets):
    return torch.log_softmax(logits.float(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def naive_entropy(logits):
    """H = −Σ_v p_v log p_v over the whole vocabulary, from a plain log_softmax."""
    log_p = torch.log_softmax(logits, -1)
    return -(log_p.exp() * log_p).sum(-1)


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_target_logprobs_equal_log_softmax_gather_values_and_gradients(dtype):
    torch.manual_seed(0)
    logits = (4 * torch.randn(3, 9, 301)).to(dtype).requires_grad_()
    targets = torch.randint(0, 301, (3, 9))
    mask = torch.rand(3, 9) < 0.6
    rows, cols = mask.nonzero(as_tuple=True)
    weights = torch.randn(rows.numel())

    got, means, entropy = TargetLogProbs.apply(logits, rows, cols, targets[rows, cols], 5)  # chunks of 5
    (got * weights).sum().backward()
    got_grad, logits.grad = logits.grad, None
    want = naive_token_logps(logits, targets)[rows, cols]
    (want * weights).sum().backward()

    assert got.dtype == torch.float32 and entropy is None
    assert torch.allclose(got, want, atol=1e-5, rtol=0)
    assert torch.allclose(means, logits.float().mean(-1)[rows, cols], atol=1e-5)
    assert got_grad.dtype == dtype
    assert torch.allclose(got_grad.float(), logits.grad.float(), atol=1e-6, rtol=0)
    assert got_grad[~mask].abs().max() == 0  # unscored positions get no gradient


@pytest.mark.unit
def test_target_logprobs_backward_passes_gradcheck_in_float64():
    torch.manual_seed(1)
    logits = torch.randn(2, 5, 7, dtype=torch.float64, requires_grad=True)
    rows, cols, targets = torch.tensor([0, 0, 1]), torch.tensor([1, 3, 4]), torch.tensor([2, 6, 0])
    assert torch.autograd.gradcheck(lambda x: TargetLogProbs.apply(x, rows, cols, targets, 2)[0], (logits,))


# How the scored positions are covered: one dense span (gaps computed through), a span per run of
# scored positions (every gap skipped), and logits that are a slice of longer rows (not viewable as
# [B·K, V]: spans stay within a row).
PLANS = {"dense": 1 << 30, "skip_gaps": 0, "sliced": 1 << 30}


@pytest.mark.unit
@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entropy_and_logprobs_equal_the_full_vocabulary_forms_for_every_chunk_plan(plan, dtype):
    """Entropy from the chunked pass equals −Σ p log p over the full vocabulary to 1e-6, log-probs
    equal log_softmax + gather; the gradients of both outputs match the naive ones."""
    torch.manual_seed(0)
    if plan == "sliced":
        full = (4 * torch.randn(3, 11, 301)).to(dtype).requires_grad_()
        logits = full[:, 2:]
    else:
        full = logits = (4 * torch.randn(3, 9, 301)).to(dtype).requires_grad_()
    targets = torch.randint(0, 301, (3, 9))
    mask = torch.zeros(3, 9, dtype=torch.bool)
    mask[0, 2:5] = mask[1, 0:9] = mask[2, 6:8] = True  # runs with gaps, a whole row, and row ends
    rows, cols = mask.nonzero(as_tuple=True)
    weights, entropy_weights = torch.randn(rows.numel()), torch.randn(rows.numel())

    with patch("trainers.scoring.logprobs.MERGE_ELEMENTS", PLANS[plan]):
        spans = plan_chunks(logits, rows, cols, 4).spans
        got, means, entropy = TargetLogProbs.apply(logits, rows, cols, targets[rows, cols], 4, True)
    assert len(spans) == {"dense": 6, "skip_gaps": 5, "sliced": 5}[plan]
    (got * weights + entropy * entropy_weights).sum().backward()
    got_grad = full.grad
    # The naive forms on a float32 copy: on bf16 logits autograd would round each branch's gradient
    # to bf16 before adding them; ours adds in float32 and rounds once.
    reference = logits.detach().float().requires_grad_()
    want = naive_token_logps(reference, targets)[rows, cols]
    want_entropy = naive_entropy(reference)[rows, cols]
    (want * weights + want_entropy * entropy_weights).sum().backward()

    assert entropy.dtype == torch.float32
    assert torch.allclose(got, want, atol=1e-5, rtol=0)
    assert (entropy - want_entropy).abs().max() <= 1e-6
    assert torch.allclose(means, logits.float().mean(-1)[rows, cols], atol=1e-5)
    assert got_grad.dtype == dtype
    scored_grad = got_grad[:, -9:].float()
    assert torch.allclose(
        scored_grad, reference.grad.to(dtype).float(), atol=1e-6, rtol=0 if dtype == torch.float32 else 2**-7
    )
    unscored = torch.ones_like(full[..., 0], dtype=torch.bool)
    unscored[:, -9:][mask] = False
    assert got_grad[unscored].abs().max() == 0  # unscored positions get exactly zero gradient


@pytest.mark.unit
@pytest.mark.parametrize("merge, temperature", [(0, 1.0), (1 << 30, 1.0), (1 << 30, 0.7)])
def test_logprobs_and_entropy_pass_gradcheck_in_float64(merge, temperature):
    torch.manual_seed(1)
    logits = torch.randn(2, 6, 7, dtype=torch.float64, requires_grad=True)
    rows, cols = torch.tensor([0, 0, 0, 1, 1]), torch.tensor([1, 3, 4, 0, 5])
    targets = torch.tensor([2, 6, 0, 3, 1])

    def outputs(x):
        return TargetLogProbs.apply(x, rows, cols, targets, 2, True, temperature)

    with patch("trainers.scoring.logprobs.MERGE_ELEMENTS", merge):
        assert torch.autograd.gradcheck(lambda x: outputs(x)[::2], (logits,))  # log-probs and entropy
        assert torch.autograd.gradcheck(lambda x: outputs(x)[2], (logits,))  # the entropy alone
        logps, _, entropy = outputs(logits)
    scaled = logits[rows, cols] / temperature
    assert torch.allclose(logps, torch.log_softmax(scaled, -1).gather(-1, targets[:, None]).squeeze(-1), atol=1e-12)
    assert torch.allclose(entropy, naive_entropy(scaled), atol=1e-12)


@pytest.mark.unit
def test_chunk_plan_spans_small_gaps_and_skips_large_ones():
    logits = torch.empty(2, 10, 100)
    rows, cols = torch.tensor([0, 0, 0, 1, 1]), torch.tensor([1, 2, 4, 7, 8])
    with patch("trainers.scoring.logprobs.MERGE_ELEMENTS", 100):  # a gap of one position (100 logits) is spanned
        plan = plan_chunks(logits, rows, cols, 3)
    assert plan.spans == [(1, 4), (4, 5), (17, 19)]
    assert plan.size == 6 and plan.where.tolist() == [0, 1, 3, 4, 5]
    with patch("trainers.scoring.logprobs.MERGE_ELEMENTS", 10**9):  # one span across the row boundary
        assert plan_chunks(logits, rows, cols, 100).spans == [(1, 19)]
        assert plan_chunks(torch.empty(2, 12, 100)[:, 2:], rows, cols, 100).spans == [(1, 5), (17, 19)]
    with pytest.raises(ValueError, match="row-major"):
        plan_chunks(logits, rows.flip(0), cols.flip(0), 3)


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


@pytest.mark.unit
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


@pytest.mark.unit
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_next_token_logps_scores_completion_positions_only_with_the_old_values_and_gradients(tiny, temperature):
    """GRPO's per-token log-probs and entropies: at completion positions equal to the old form (full
    projection of every position, log_softmax + gather, −Σ p log p), 0 elsewhere; the model is
    asked for ``logits_to_keep``, and a model without it gives the same values. Gradients of
    ``Σ w·logp + Σ u·H`` equal the old form's."""
    model, tokenizer = tiny
    batch = prompt_completion_batch(
        [[10, 11, 12, 14], [13, 15], [16, 17, 18]], [[20, 21], [22, 23, 24, 25, 2], []], tokenizer.pad_token_id
    )
    ids, attention, mask = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    scored = mask[:, 1:].bool()
    torch.manual_seed(0)
    weights, entropy_weights = torch.randn(scored.shape), torch.randn(scored.shape)

    def gradients(fn):
        model.zero_grad()
        logps, entropy = fn()
        ((logps * weights + entropy * entropy_weights) * scored).sum().backward()
        return (logps.detach(), entropy.detach()), [p.grad.clone() for p in model.parameters()]

    def old_form():
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1] / temperature
        return naive_token_logps(logits, ids[:, 1:]), naive_entropy(logits)

    spy = LogitsToKeepSpy(model)
    (logps, entropy), ours = gradients(lambda: next_token_logps(spy, ids, attention, mask, temperature, entropy=True))
    assert spy.requested == [6]  # the first completion token is at index 2: positions 1..6
    (want_logps, want_entropy), reference = gradients(old_form)
    assert logps.shape == entropy.shape == scored.shape
    assert torch.allclose(logps[scored], want_logps[scored], atol=1e-5, rtol=0)
    # float32 entropies near 4.6 summed in another order: within 4 ulps (2.2e-6; 1.4e-6 seen at 0.7 on one thread)
    ulp = want_entropy[scored].abs() * torch.finfo(torch.float32).eps
    ulps = (entropy[scored] - want_entropy[scored]).abs() / ulp
    assert ulps.max() <= 4
    assert logps[~scored].abs().max() == 0 and entropy[~scored].abs().max() == 0
    for got, want in zip(ours, reference):
        assert torch.allclose(got, want, atol=1e-5)
    fallback = next_token_logps(FullLogitsOnly(model), ids, attention, mask, temperature)
    assert fallback.entropy is None and torch.allclose(fallback.logps, logps, atol=1e-6, rtol=0)
    model.zero_grad()


@pytest.mark.unit
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
    with patch("trainers.scoring.logprobs.CHUNK_ELEMENTS", 1):
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


@pytest.mark.unit
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


@pytest.mark.unit
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


# Peak memory: each test's forms run one after the other in a fresh interpreter (one import of
# torch and transformers per test, the slow part). After the logits exist, the kernel's
# peak-RSS mark is reset to the current RSS (/proc/self/clear_refs); the figure is the peak
# (VmHWM) reached during the log-prob computation, forward and backward, minus that RSS.
# (ru_maxrss would not do: a child starts with its parent's peak.) glibc's mmap threshold is
# pinned at 128 KiB so that every freed tensor buffer goes back to the OS; by default the
# threshold grows after frees and freed chunks stay resident, inflating RSS (and the next form's
# baseline).
PEAK_SCRIPT = textwrap.dedent(
    """
    import re, sys, torch
    from trainers.scoring.logprobs import CHUNK_ELEMENTS, TargetLogProbs

    def kib(field):
        return int(re.search(field + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))

    def peak_growth(form):
        torch.manual_seed(0)
        rows, positions, vocab = (2 if form.startswith("grpo") else 4), 128, 32768
        logits = torch.randn(rows, positions, vocab, dtype=torch.bfloat16).requires_grad_()
        targets = torch.randint(0, vocab, (rows, positions))
        r, c = torch.ones(rows, positions, dtype=torch.bool).nonzero(as_tuple=True)
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        before = kib("VmRSS")
        chunk = CHUNK_ELEMENTS // vocab
        if form == "naive":
            logps = torch.log_softmax(logits.float(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1).sum()
        elif form == "grpo_old":  # GRPO's former step: the log-probs, then the entropy metric from
            logps = TargetLogProbs.apply(logits, r, c, targets[r, c], chunk)[0].sum()  # full-vocabulary
            with torch.no_grad():  # softmax and log_softmax
                entropy = -(torch.softmax(logits.float(), -1) * torch.log_softmax(logits.float(), -1)).sum(-1)
        elif form == "grpo_ours":  # the entropy from the log-probs' own chunked pass
            logps, _, entropy = TargetLogProbs.apply(logits, r, c, targets[r, c], chunk, True)
            logps = logps.sum()
        else:
            logps = TargetLogProbs.apply(logits, r, c, targets[r, c], chunk)[0].sum()
        logps.backward()
        return kib("VmHWM") - before

    for form in sys.argv[1:]:
        print(peak_growth(form))  # everything it allocated is freed (and unmapped) on return
    """
)


def peak_growth_mib(*forms: str) -> list[float]:
    """Peak RSS growth of each form, measured one after the other in one fresh interpreter."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, *forms], capture_output=True, text=True, check=True, timeout=300, env=env
    )
    return [int(line) / 1024 for line in result.stdout.split()]


@pytest.mark.slow
def test_peak_memory_is_below_the_naive_form_on_a_large_vocabulary():
    """bf16 logits of 4 × 128 × 32768 (32 MiB; a float32 copy is 64 MiB), forward and backward.

    Measured here: naive ≈ 196 MiB (float32 copy + float32 log_softmax + their gradients), ours ≈
    64 MiB (the bf16 gradient of the logits, needed by both, plus float32 chunk temporaries; 95 MiB
    before the chunks became views of the logits and the gradient lost its zero fill).
    """
    naive, ours = peak_growth_mib("naive", "ours")
    float32_copy = 4 * 128 * 32768 * 4 / 2**20
    assert naive > 2 * float32_copy, naive
    assert naive - ours > float32_copy, (naive, ours)  # at least one full float32 logits copy less


@pytest.mark.slow
def test_grpo_entropy_from_the_chunked_pass_saves_the_full_vocabulary_copies():
    """GRPO: log-probs with backward plus the entropy metric, on bf16 logits of 2 × 128 × 32768
    (16 MiB; a float32 copy is 32 MiB). The former metric (softmax and log_softmax of float32 copies,
    and their product) held several float32 copies at once; the chunked pass holds none.

    Measured here: former ≈ 104 MiB, ours ≈ 56 MiB (the bf16 gradient, needed by both, plus float32
    chunk temporaries).
    """
    former, ours = peak_growth_mib("grpo_old", "grpo_ours")
    float32_copy = 2 * 128 * 32768 * 4 / 2**20
    assert former - ours > float32_copy, (former, ours)  # at least one full float32 logits copy less
