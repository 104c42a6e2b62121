"""Sampling for ``generate`` without ``torch.multinomial``.

On the CPU ``torch.multinomial`` draws its randomness element by element: 10.9 ms for one token of
16 rows over a 32,000-token vocabulary on one core, more than the tiny policy's forward pass, and
more than half of a GRPO generation step (``benchmarks/README.md``). Inverse transform sampling
needs one uniform number per row and a cumulative sum: under 1 ms for the same rows.

:func:`sampling_processors` gives ``generate`` the usual warpers (temperature, top-k, top-p, in the
order ``generate`` itself applies them) followed by :class:`InverseCdfSampling`, which draws the
token and leaves it the only finite score, under greedy decoding: the arg max is the drawn token.
The tokens come from the same distribution as ``do_sample=True`` (another random stream).
"""

from __future__ import annotations

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


class InverseCdfSampling(LogitsProcessor):
    """One token per row drawn from ``softmax(scores)``; returns 0 at it and −inf elsewhere.

    With ``F_j = Σ_{k≤j} p_k`` (in float64) and ``u ~ U[0, 1)`` per row, the token is
    ``min{j : F_j > u · F_V}``: it is ``j`` with probability ``p_j``, and never a token whose score
    is −inf (its ``F`` equals its predecessor's)."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        cdf = scores.softmax(-1, dtype=torch.float64).cumsum_(-1)
        uniform = torch.rand((scores.shape[0], 1), dtype=torch.float64, device=scores.device)
        drawn = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).clamp_(max=scores.shape[-1] - 1)
        return torch.full_like(scores, float("-inf")).scatter_(-1, drawn, 0.0)


class VocabularyMask(LogitsProcessor):
    """−inf for the ids from ``vocabulary`` on: an embedding padded beyond its tokenizer (as Qwen's
    are) has rows that name no token, which another model of the family may not have at all."""

    def __init__(self, vocabulary: int):
        self.vocabulary = vocabulary

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        return scores.index_fill(-1, torch.arange(self.vocabulary, scores.shape[-1], device=scores.device), -torch.inf)


def sampling_processors(
    temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, vocabulary: int | None = None
) -> LogitsProcessorList:
    """``generate``'s ``logits_processor`` that samples at ``temperature`` with top-k (0: off) and
    top-p (1: off) through :class:`InverseCdfSampling`; generate with ``do_sample=False``. With
    ``vocabulary``, only ids below it are drawn (:class:`VocabularyMask`)."""
    warpers = [
        *([VocabularyMask(vocabulary)] if vocabulary is not None else []),
        *([TemperatureLogitsWarper(temperature)] if temperature != 1.0 else []),
        *([TopKLogitsWarper(top_k)] if top_k > 0 else []),
        *([TopPLogitsWarper(top_p)] if top_p < 1.0 else []),
    ]
    return LogitsProcessorList([*warpers, InverseCdfSampling()])


def sampled_generation_config(max_new_tokens: int, pad_token_id: int, stop_ids: tuple[int, ...]) -> GenerationConfig:
    """``generate``'s config beside :func:`sampling_processors`: greedy over the processors' output
    (which leaves only the drawn token), stopping at any of ``stop_ids``."""
    return GenerationConfig(
        do_sample=False,  # the tokens are sampled by the processors: greedy emits them
        max_new_tokens=max_new_tokens,
        use_cache=True,
        pad_token_id=pad_token_id,
        eos_token_id=list(stop_ids),
    )
