"""Sequence log-probabilities of completion tokens.

The one implementation used by the DPO trainer, by reference caching and by evaluation, so
cached and live reference values can never disagree.

Two savings over ``log_softmax(logits).gather(...)``:

* the model projects onto the vocabulary only from the first position that predicts a
  completion token (``logits_to_keep``, when its ``forward`` accepts it), so a long prompt
  costs no ``lm_head`` work and no logits memory;
* the target token's log-prob is ``z[target] − logsumexp(z)``, computed in float32 over chunks
  of scored positions; the backward pass recomputes the softmax chunk by chunk. Neither pass
  holds a full-vocabulary float32 copy of the logits, only ``chunk × vocab`` temporaries.
"""

from __future__ import annotations

import functools
import inspect
from typing import NamedTuple

import torch
from transformers.modeling_utils import unwrap_model

# Float32 elements of one chunk of (scored positions × vocabulary): 16 MiB.
CHUNK_ELEMENTS = 1 << 22


class CompletionLogps(NamedTuple):
    """Per-row results of :func:`completion_logps`; every field has shape ``(rows,)``, float32
    (float64 for a float64 model)."""

    logps: torch.Tensor  # Σ_t m_t · log p(x_t | x_<t); differentiable
    num_tokens: torch.Tensor  # Σ_t m_t: completion tokens scored
    logit_sums: torch.Tensor  # Σ_t m_t · mean_v z_{t,v}: for the ``logits/*`` metrics; no gradient
    # With ``wpo_terms=True``: (1/Σ_t m_t) Σ_t m_t [log p(x_t) − log Σ_v p_v²], WPO's log-weight of the
    # row (unweighted token log-probs); no gradient. None otherwise.
    wpo_logweights: torch.Tensor | None = None


class TargetLogProbs(torch.autograd.Function):
    """``log_softmax(logits[rows, cols])[targets]`` and the vocabulary-mean logit at those
    positions, in float32 (float64 for float64 logits), ``chunk`` positions at a time.

    Backward: ``∂/∂z_v = g · (1[v = target] − softmax(z)_v)``, recomputed per chunk from the saved
    logits (the original tensor, not a copy) and the saved per-position logsumexp.
    """

    @staticmethod
    def forward(ctx, logits, rows, cols, targets, chunk):
        count = rows.numel()
        logps = torch.empty(count, dtype=compute_dtype(logits), device=logits.device)
        means = torch.empty_like(logps)
        normalisers = torch.empty_like(logps)
        for start in range(0, count, chunk):
            part = slice(start, start + chunk)
            block = logits[rows[part], cols[part]].to(logps.dtype)
            normalisers[part] = block.logsumexp(-1)
            logps[part] = block.gather(-1, targets[part, None]).squeeze(-1) - normalisers[part]
            means[part] = block.mean(-1)
        ctx.save_for_backward(logits, rows, cols, targets, normalisers)
        ctx.chunk = chunk
        ctx.mark_non_differentiable(means)
        return logps, means

    @staticmethod
    def backward(ctx, grad_logps, grad_means):
        logits, rows, cols, targets, normalisers = ctx.saved_tensors
        grad = torch.zeros_like(logits)
        for start in range(0, rows.numel(), ctx.chunk):
            part = slice(start, start + ctx.chunk)
            scale = grad_logps[part, None]
            block = logits[rows[part], cols[part]].to(normalisers.dtype)
            block_grad = (block - normalisers[part, None]).exp_().mul_(-scale)
            block_grad.scatter_add_(-1, targets[part, None], scale)
            grad[rows[part], cols[part]] = block_grad.to(grad.dtype)
        return grad, None, None, None, None


def compute_dtype(logits: torch.Tensor) -> torch.dtype:
    """Float32, or float64 for float64 logits (which keeps ``gradcheck`` meaningful)."""
    return torch.promote_types(logits.dtype, torch.float32)


@functools.cache
def accepts_logits_to_keep(model_class: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def collision_logps(logits: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, chunk: int) -> torch.Tensor:
    """``log Σ_v p_v²`` of ``softmax(logits[rows, cols])`` (the log-probability that two draws
    agree), ``chunk`` positions at a time, without gradient; as :class:`TargetLogProbs`' dtype."""
    out = torch.empty(rows.numel(), dtype=compute_dtype(logits), device=logits.device)
    with torch.no_grad():
        for start in range(0, rows.numel(), chunk):
            part = slice(start, start + chunk)
            block = logits[rows[part], cols[part]].to(out.dtype)
            out[part] = (2 * block).logsumexp(-1) - 2 * block.logsumexp(-1)
    return out


def completion_logps(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    token_weights: torch.Tensor | None = None,
    wpo_terms: bool = False,
) -> CompletionLogps:
    """Summed log-probs of the completion tokens of each row: ``sum_t m_t log p(x_t | x_<t)``.

    Position ``t`` of the logits predicts token ``t + 1``; prompt and padding carry ``m_t = 0``.
    One forward over all rows (the trainer passes chosen and rejected concatenated).

    Options for the DPO trainer, which cost nothing when off (the reference cache never sets them):
    ``token_weights`` (shaped like ``input_ids``, the weight ``w_t`` of token ``x_t``) makes ``logps``
    ``sum_t m_t w_t log p(x_t | x_<t)`` (LD-DPO); ``wpo_terms`` fills ``wpo_logweights``, one more
    pass over the vocabulary of the scored positions, without gradient (WPO).
    """
    scored = completion_mask[:, 1:].bool()  # scored[:, t]: position t predicts a completion token
    has_scored = scored.any(0)
    first = int(has_scored.float().argmax()) if bool(has_scored.any()) else scored.shape[1] - 1
    kept = input_ids.shape[1] - first  # positions first .. last, the last predicting nothing
    extra = {"logits_to_keep": kept} if accepts_logits_to_keep(type(unwrap_model(model))) else {}
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **extra).logits
    logits = logits[:, -kept:]  # a view; already this shape when logits_to_keep was honoured

    rows, cols = scored[:, first:].nonzero(as_tuple=True)
    targets = input_ids[:, first + 1 :][rows, cols]
    chunk = max(1, CHUNK_ELEMENTS // logits.shape[-1])
    token_logps, token_means = TargetLogProbs.apply(logits, rows, cols, targets, chunk)

    def per_row(values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(input_ids.shape[0], dtype=values.dtype, device=values.device).index_add(0, rows, values)

    num_tokens = scored.sum(-1).float()
    wpo_logweights = None
    if wpo_terms:
        collisions = collision_logps(logits, rows, cols, chunk)
        wpo_logweights = per_row(token_logps.detach() - collisions) / num_tokens.clamp(min=1).to(collisions.dtype)
    if token_weights is not None:
        token_logps = token_logps * token_weights[:, first + 1 :][rows, cols].to(token_logps.dtype)
    return CompletionLogps(
        logps=per_row(token_logps),
        num_tokens=num_tokens,
        logit_sums=per_row(token_means.detach()),
        wpo_logweights=wpo_logweights,
    )


def next_token_logps(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs ``log p(x_{t+1} | x_≤t)``, shape ``[B, T − 1]``, of the distribution
    ``softmax(logits / temperature)``, and those scaled logits (for entropies). GRPO's per-token
    counterpart of :func:`completion_logps`, on the same chunked :class:`TargetLogProbs`."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1]
    if temperature != 1.0:
        logits = logits / temperature
    rows, cols = torch.ones(logits.shape[:2], dtype=torch.bool, device=logits.device).nonzero(as_tuple=True)
    chunk = max(1, CHUNK_ELEMENTS // logits.shape[-1])
    logps, _ = TargetLogProbs.apply(logits, rows, cols, input_ids[:, 1:][rows, cols], chunk)
    return logps.view(logits.shape[:2]), logits
