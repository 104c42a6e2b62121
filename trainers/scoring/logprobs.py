"""Log-probabilities of completion tokens: per sequence (:func:`completion_logps`) and per token
(:func:`next_token_logps`, GRPO's, optionally with each position's entropy).

The one implementation used by the DPO trainer, by reference caching, by evaluation and by the GRPO
trainer, so cached and live reference values can never disagree.

Savings over ``log_softmax(logits).gather(...)``:

* the model projects onto the vocabulary only from the first position that predicts a
  completion token (``logits_to_keep``, when its ``forward`` accepts it), so a long prompt
  costs no ``lm_head`` work and no logits memory;
* the target token's log-prob is ``z[target] − logsumexp(z)``, computed in float32 over chunks
  of positions; the backward pass recomputes the softmax chunk by chunk. Neither pass holds a
  full-vocabulary float32 copy of the logits, only ``chunk × vocab`` temporaries;
* each chunk is a view of a contiguous span of positions (gaps of unscored positions are computed
  through when short, skipped when long: :func:`plan_chunks`), so nothing is copied out of the
  logits by index, and the gradient is written span by span into an uninitialised tensor;
* the entropy (GRPO's metric, bonus and token selection) comes from the same chunks and their
  logsumexp, with its own backward, instead of a second full-vocabulary pass.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, NamedTuple

import torch

from trainers.data.packing import packed_batch
from trainers.models.attention import Packing
from trainers.models.transformers_compat import head_inputs, innermost_model, plain_output_head
from trainers.scoring.chunked_head import HeadTargetLogProbs

# Float32 elements of one chunk of (scored positions × vocabulary): 16 MiB.
CHUNK_ELEMENTS = 1 << 22
# Logits beyond this many elements (256 MiB in float32) are not materialised where the head allows it:
# the head is applied in chunks (:class:`~trainers.scoring.chunked_head.HeadTargetLogProbs`).
HEAD_IN_CHUNKS_ELEMENTS = 1 << 26
# Unscored positions between two scored ones are computed through (and their results dropped) when
# that costs at most this many logits; a longer gap starts a new chunk. A chunk costs a fixed ~15
# tensor operations, worth about this many elements: a small vocabulary gets one dense pass, a large
# one skips each prompt.
MERGE_ELEMENTS = 1 << 16


class CompletionLogps(NamedTuple):
    """Per-row results of :func:`completion_logps`; every field has shape ``(rows,)``, float32
    (float64 for a float64 model)."""

    logps: torch.Tensor  # Σ_t m_t · log p(x_t | x_<t); differentiable
    num_tokens: torch.Tensor  # Σ_t m_t: completion tokens scored
    logit_sums: torch.Tensor  # Σ_t m_t · mean_v z_{t,v}: for the ``logits/*`` metrics; no gradient
    # With ``wpo_terms=True``: (1/Σ_t m_t) Σ_t m_t [log p(x_t) − log Σ_v p_v²], WPO's log-weight of the
    # row (unweighted token log-probs); no gradient. None otherwise.
    wpo_logweights: torch.Tensor | None = None
    # With ``token_weights``: Σ_t m_t log p(x_t), the row's log-likelihood before the weights (``logps``
    # is the weighted sum); differentiable. None otherwise (``logps`` is that sum).
    unweighted_logps: torch.Tensor | None = None


class TokenLogps(NamedTuple):
    """Per-token results of :func:`next_token_logps`, shape ``[B, T − 1]`` (position ``t`` predicts
    token ``t + 1``), float32 (float64 for a float64 model). Only positions that predict a completion
    token are computed; every other position holds 0."""

    logps: torch.Tensor  # log p(x_{t+1} | x_≤t); differentiable
    entropy: torch.Tensor | None = None  # H_t = −Σ_v p_v log p_v (``entropy=True``); differentiable


class ChunkPlan(NamedTuple):
    """Where :class:`TargetLogProbs` reads: ``spans``, ascending ``(start, stop)`` ranges of flat
    positions ``row · K + col``, each at most ``chunk`` long, within one row when the logits cannot
    be viewed as ``[B·K, V]``. Their positions, concatenated, form the *span space*, of ``size``
    positions; ``where[i]`` is scored position ``i``'s index in it (None when every spanned position
    is scored, i.e. ``where`` would be ``arange``)."""

    spans: list[tuple[int, int]]
    size: int
    where: torch.Tensor | None


def plan_chunks(logits: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, chunk: int) -> ChunkPlan:
    """Cover the scored positions (row-major, no repeats) with contiguous spans of positions, so
    that every chunk is a view of the logits: no indexed copy. A gap of unscored positions is
    spanned when it costs at most ``MERGE_ELEMENTS`` logits; its results are computed and dropped."""
    count = rows.numel()
    if count == 0:
        return ChunkPlan([], 0, None)
    width, vocab = logits.shape[1], logits.shape[2]
    flat = rows * width + cols
    steps = flat[1:] - flat[:-1]
    if count > 1 and bool((steps <= 0).any()):
        raise ValueError("TargetLogProbs: positions must be in row-major order without repeats")
    cut = (steps - 1) * vocab > MERGE_ELEMENTS
    if not can_flatten(logits):
        cut |= rows[1:] != rows[:-1]
    starts = torch.cat([cut.new_ones(1), cut]).nonzero().squeeze(-1)
    stops = torch.cat([starts[1:], starts.new_tensor([count])]) - 1
    firsts, lasts = flat[starts].tolist(), (flat[stops] + 1).tolist()
    spans = [(a, min(a + chunk, last)) for first, last in zip(firsts, lasts) for a in range(first, last, chunk)]
    lengths = torch.tensor([last - first for first, last in zip(firsts, lasts)], device=flat.device)
    size = int(sum(last - first for first, last in zip(firsts, lasts)))
    if size == count:
        return ChunkPlan(spans, size, None)
    offsets = lengths.cumsum(0) - lengths  # where each group of spans begins in span space
    group = torch.cat([cut.new_zeros(1, dtype=torch.long), cut.long().cumsum(0)])
    return ChunkPlan(spans, size, flat - flat[starts][group] + offsets[group])


def can_flatten(logits: torch.Tensor) -> bool:
    """Whether ``logits`` ``[B, K, V]`` is viewable as ``[B·K, V]`` (a ``logits_to_keep`` output is;
    a slice ``logits[:, -K:]`` of longer rows is not)."""
    b, k, v = logits.shape
    return logits.stride(2) == 1 and (b == 1 or logits.stride(0) == k * logits.stride(1)) and logits.stride(1) >= v


def read_span(logits: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Flat positions ``start:stop`` of ``logits`` ``[B, K, V]`` as a ``[stop − start, V]`` view."""
    if can_flatten(logits):
        return logits.view(-1, logits.shape[-1])[start:stop]
    row, col = divmod(start, logits.shape[1])
    return logits[row, col : col + stop - start]


def to_span_space(values: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    """Per-scored-position ``values`` spread over span space (0 at spanned, unscored positions)."""
    if plan.where is None:
        return values
    return values.new_zeros(plan.size).index_copy_(0, plan.where, values)


def from_span_space(values: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    return values if plan.where is None else values[plan.where]


class TargetLogProbs(torch.autograd.Function):
    """``log_softmax(logits[rows, cols])[targets]``, the vocabulary-mean logit at those positions
    and, with ``entropy=True``, the entropy ``H = −Σ_v p_v log p_v`` there (``log p = z − logsumexp(z)``,
    the chunk's own logsumexp; else None), in float32 (float64 for float64 logits), ``chunk``
    positions at a time. ``rows, cols`` are row-major without repeats (as ``nonzero`` gives them).
    With ``temperature``, all of these are of ``z = logits / temperature``, divided per chunk.

    Each chunk is a view of a contiguous span of positions (:func:`plan_chunks`), converted to
    float32 once; nothing indexes a copy out of the logits. Backward:
    ``∂/∂z_v = g · (1[v = target] − p_v) − g_H · p_v (z_v − logsumexp(z) + H)``, recomputed per chunk
    from the saved logits (the original tensor, not a copy) and the saved per-position logsumexp,
    written chunk by chunk into an uninitialised gradient; only positions outside every span are
    zero-filled.
    """

    @staticmethod
    def forward(ctx, logits, rows, cols, targets, chunk, entropy=False, temperature=1.0):
        plan = plan_chunks(logits, rows, cols, chunk)
        dtype = compute_dtype(logits)
        span_targets = to_span_space(targets, plan)
        normalisers = torch.empty(plan.size, dtype=dtype, device=logits.device)
        logps, means = torch.empty_like(normalisers), torch.empty_like(normalisers)
        entropies = torch.empty_like(normalisers) if entropy else None
        offset = 0
        for start, stop in plan.spans:
            part = slice(offset, offset + stop - start)
            offset = part.stop
            source = read_span(logits, start, stop)
            block = source.to(dtype)  # a float32 copy of bf16 logits; float32 logits: the view itself
            if temperature != 1.0:
                block = block.div_(temperature) if block is not source else block / temperature
            normalisers[part] = block.logsumexp(-1)
            logps[part] = block.gather(-1, span_targets[part, None]).squeeze(-1) - normalisers[part]
            means[part] = block.mean(-1)
            if entropies is not None:  # −Σ p log p from log p = z − logsumexp(z), as precise as log_softmax
                shift = normalisers[part, None]
                log_probs = block.sub_(shift) if block is not source else block - shift
                entropies[part] = log_probs.exp().mul_(log_probs).sum(-1).neg_()
        ctx.save_for_backward(logits, span_targets, normalisers, entropies)
        ctx.plan, ctx.temperature = plan, temperature
        ctx.set_materialize_grads(False)
        means = from_span_space(means, plan)
        ctx.mark_non_differentiable(means)
        return from_span_space(logps, plan), means, None if entropies is None else from_span_space(entropies, plan)

    @staticmethod
    def backward(ctx, grad_logps, grad_means, grad_entropy):
        if grad_logps is None and grad_entropy is None:
            return None, None, None, None, None, None, None
        logits, span_targets, normalisers, entropies = ctx.saved_tensors
        plan: ChunkPlan = ctx.plan
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        flat_grad = grad.view(-1, logits.shape[-1])
        scale = to_span_space(grad_logps, plan) if grad_logps is not None else None
        entropy_scale = to_span_space(grad_entropy, plan) if grad_entropy is not None else None
        previous, offset = 0, 0
        for start, stop in plan.spans:
            flat_grad[previous:start].zero_()
            previous = stop
            part = slice(offset, offset + stop - start)
            offset = part.stop
            source = read_span(logits, start, stop)
            block = source.to(normalisers.dtype)
            if ctx.temperature != 1.0:
                block = block.div_(ctx.temperature) if block is not source else block / ctx.temperature
            out = flat_grad[start:stop]
            factor = None
            if entropy_scale is not None:  # g + g_H (z_v − logsumexp + H)
                factor = block - (normalisers[part] - entropies[part])[:, None]
                factor.mul_(entropy_scale[part, None])
                if scale is not None:
                    factor.add_(scale[part, None])
            if block is not source:  # our own float32 copy: p_v in place, converted into out at the end
                work = block.sub_(normalisers[part, None]).exp_()
            else:  # the logits themselves: p_v straight into the gradient
                work = torch.sub(block, normalisers[part, None], out=out).exp_()
            if factor is not None:
                work.mul_(factor).neg_()
            elif scale is not None:  # one of the two gradients is there (else backward returned above)
                work.mul_(-scale[part, None])
            if scale is not None:
                work.scatter_add_(-1, span_targets[part, None], scale[part, None])
            if ctx.temperature != 1.0:  # ∂/∂logits = ∂/∂z / temperature
                work.div_(ctx.temperature)
            if work is not out:
                out.copy_(work)
        flat_grad[previous:].zero_()
        return grad, None, None, None, None, None, None


def compute_dtype(logits: torch.Tensor) -> torch.dtype:
    """Float32, or float64 for float64 logits (which keeps ``gradcheck`` meaningful)."""
    return torch.promote_types(logits.dtype, torch.float32)


@functools.cache
def accepts_logits_to_keep(forward: Callable[..., Any]) -> bool:
    """Whether a model class's ``forward`` takes ``logits_to_keep``."""
    return "logits_to_keep" in inspect.signature(forward).parameters


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


class ScoredForward(NamedTuple):
    """The model's logits at the positions that predict a completion token (and, padded, the
    positions between the first of them and the end), and where each scored position is: ``rows``
    and ``cols`` in the padded batch (row-major), ``at_rows`` and ``at_cols`` in ``logits``."""

    scored: torch.Tensor  # [B, T − 1] bool: position t predicts a completion token
    rows: torch.Tensor  # position ``cols`` of row ``rows`` predicts its token ``cols + 1``
    cols: torch.Tensor
    targets: torch.Tensor  # the completion token each scored position predicts
    logits: torch.Tensor  # [B, T − first, V] (a view), or the packed rows' [packs, kept, V]
    at_rows: torch.Tensor
    at_cols: torch.Tensor
    # Padding-free: the scored positions in the logits' row-major order (:class:`TargetLogProbs`
    # reads them so); None when ``rows``/``cols`` are in it already.
    order: torch.Tensor | None
    chunk: int  # positions per chunk of :class:`TargetLogProbs`
    # With the head applied in chunks (:func:`forward_scored_positions`): the last hidden states of the
    # scored positions ``[scored, H]`` in the order of ``rows``/``cols``, and the output projection;
    # ``logits`` then holds none.
    hidden: torch.Tensor | None = None
    head: torch.nn.Linear | None = None

    def target_logps(
        self, entropy: bool = False, temperature: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """:class:`TargetLogProbs` of the scored positions (log-prob, mean logit, entropy), in the order
        of ``rows``/``cols``."""
        if self.head is not None and self.hidden is not None:
            head = self.head
            return HeadTargetLogProbs.apply(
                self.hidden, head.weight, head.bias, self.targets, self.chunk, entropy, temperature
            )
        rows, cols, targets, order = self.at_rows, self.at_cols, self.targets, self.order
        if order is not None:
            rows, cols, targets = rows[order], cols[order], targets[order]
        logps, means, entropies = TargetLogProbs.apply(
            self.logits, rows, cols, targets, self.chunk, entropy, temperature
        )
        if order is None:
            return logps, means, entropies
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return logps[inverse], means[inverse], None if entropies is None else entropies[inverse]

    def scored_logits(self) -> torch.Tensor:
        """``[scored positions, V]``: the logits of the scored positions, in the order of ``rows``/``cols`` (a copy)."""
        if self.head is not None:
            raise ValueError("scored_logits: this forward kept no logits (forward_scored_positions(needs_logits=True))")
        return self.logits[self.at_rows, self.at_cols]


def forward_scored_positions(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    packing: Packing | None = None,
    needs_logits: bool = False,
) -> ScoredForward:
    """One forward, projecting onto the vocabulary only where a completion token is predicted.

    Padded (``packing`` None): from the first position that predicts a completion token
    (``logits_to_keep`` when the model takes it; a view of the logits otherwise). Padding-free: the
    rows packed without their padding (:class:`~trainers.data.packing.PackedBatch`, ``position_ids``
    restarting per row and no ``attention_mask``, so the attention implementation keeps them apart),
    projected at the scored slots of the packs only. Either way, when those logits would exceed
    ``HEAD_IN_CHUNKS_ELEMENTS`` and the model's head allows it (``plain_output_head``), the model
    stops at the head's input and :class:`HeadTargetLogProbs` applies the head chunk by chunk,
    unless the caller ``needs_logits`` (:meth:`ScoredForward.scored_logits`)."""
    scored = completion_mask[:, 1:].bool() & attention_mask[:, :-1].bool()
    rows, cols = scored.nonzero(as_tuple=True)
    targets = input_ids[rows, cols + 1]
    takes_kept = accepts_logits_to_keep(type(innermost_model(model)).forward)
    packed = None if packing is None else packed_batch(attention_mask, packing)
    if packed is None:
        first = int(cols.min()) if cols.numel() else scored.shape[1] - 1
        kept = input_ids.shape[1] - first  # positions first .. last, the last predicting nothing
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "logits_to_keep": kept}
        at_rows, at_cols, kept_logits = rows, cols - first, input_ids.shape[0] * kept
    else:
        pack_rows, pack_cols = packed.locate(rows, cols)
        slots = pack_cols.unique()  # sorted: the packs' slots that any pack scores
        ids = packed.scatter(input_ids, attention_mask)
        inputs = {"input_ids": ids, "position_ids": packed.position_ids(input_ids.device), "logits_to_keep": slots}
        at_rows, at_cols, kept_logits = pack_rows, torch.searchsorted(slots, pack_cols), ids.shape[0] * slots.numel()
    if not takes_kept:
        del inputs["logits_to_keep"]
    head = None if needs_logits or not takes_kept else plain_output_head(model)
    if head is not None and kept_logits * head.out_features <= HEAD_IN_CHUNKS_ELEMENTS:
        head = None
    with head_inputs(head) as captured:
        logits = model(**inputs, use_cache=False).logits
    if head is not None:
        chunk = max(1, CHUNK_ELEMENTS // head.out_features)
        hidden = captured[0][at_rows, at_cols]
        return ScoredForward(scored, rows, cols, targets, logits, at_rows, at_cols, None, chunk, hidden, head)
    if packed is None:
        logits = logits[:, -kept:]  # a view; already this shape when logits_to_keep was honoured
        order = None
    else:
        if not takes_kept:
            logits = logits[:, slots]
        order = (at_rows * slots.numel() + at_cols).argsort()
    chunk = max(1, CHUNK_ELEMENTS // logits.shape[-1])
    return ScoredForward(scored, rows, cols, targets, logits, at_rows, at_cols, order, chunk)


def completion_logps(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    token_weights: torch.Tensor | None = None,
    wpo_terms: bool = False,
    packing: Packing | None = None,
) -> CompletionLogps:
    """Summed log-probs of the completion tokens of each row: ``sum_t m_t log p(x_t | x_<t)``.

    Position ``t`` of the logits predicts token ``t + 1``; prompt and padding carry ``m_t = 0``.
    One forward over all rows (the trainer passes chosen and rejected concatenated); padding-free
    with ``packing`` (:func:`forward_scored_positions`), the same values either way.

    Options for the DPO trainer, which cost nothing when off (the reference cache never sets them):
    ``token_weights`` (shaped like ``input_ids``, the weight ``w_t`` of token ``x_t``) makes ``logps``
    ``sum_t m_t w_t log p(x_t | x_<t)`` (LD-DPO); ``wpo_terms`` fills ``wpo_logweights``, one more
    pass over the vocabulary of the scored positions, without gradient (WPO).
    """
    forward = forward_scored_positions(model, input_ids, attention_mask, completion_mask, packing, wpo_terms)
    rows = forward.rows
    token_logps, token_means, _ = forward.target_logps()

    def per_row(values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(input_ids.shape[0], dtype=values.dtype, device=values.device).index_add(0, rows, values)

    num_tokens = forward.scored.sum(-1).float()
    wpo_logweights = None
    if wpo_terms:
        collisions = collision_logps(forward.logits, forward.at_rows, forward.at_cols, forward.chunk)
        wpo_logweights = per_row(token_logps.detach() - collisions) / num_tokens.clamp(min=1).to(collisions.dtype)
    unweighted_logps = None
    if token_weights is not None:
        unweighted_logps = per_row(token_logps)
        token_logps = token_logps * token_weights[rows, forward.cols + 1].to(token_logps.dtype)
    return CompletionLogps(
        unweighted_logps=unweighted_logps,
        logps=per_row(token_logps),
        num_tokens=num_tokens,
        logit_sums=per_row(token_means.detach()),
        wpo_logweights=wpo_logweights,
    )


def next_token_logps(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float = 1.0,
    *,
    entropy: bool = False,
    packing: Packing | None = None,
) -> TokenLogps:
    """Per-token log-probs ``log p(x_{t+1} | x_≤t)`` of the completion tokens, shape ``[B, T − 1]``
    (0 at positions that predict no completion token), of ``softmax(logits / temperature)``, and
    with ``entropy=True`` that distribution's entropy at the same positions, from the same chunked
    pass (:class:`TargetLogProbs`; its gradient flows only if the caller backpropagates through it).
    GRPO's per-token counterpart of :func:`completion_logps`: the same forward (padded or with
    ``packing``) and chunks, so prompt positions cost no vocabulary projection and no scoring."""
    forward = forward_scored_positions(model, input_ids, attention_mask, completion_mask, packing)
    # softmax(logits / temperature): the chunks are scaled as they are read, no scaled copy of the logits
    token_logps, _, token_entropy = forward.target_logps(entropy, temperature)

    def per_token(values: torch.Tensor) -> torch.Tensor:
        return values.new_zeros(forward.scored.shape).index_put((forward.rows, forward.cols), values)

    return TokenLogps(per_token(token_logps), None if token_entropy is None else per_token(token_entropy))
