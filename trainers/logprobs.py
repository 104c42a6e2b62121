"""Sequence log-probabilities of completion tokens.

The one implementation used by the DPO trainer, by reference caching and by evaluation, so
cached and live reference values can never disagree.
"""

from __future__ import annotations

import torch

LOGPROB_CODE_VERSION = "completion-logps-v1"


def token_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)[target]`` computed as ``logit[target] - logsumexp(logits)`` in float32,
    one row at a time, without materialising a full-vocabulary log-softmax copy."""
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1).float()
    normaliser = torch.stack([row.float().logsumexp(-1) for row in logits])
    return picked - normaliser


def completion_logps(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
) -> torch.Tensor:
    """Summed log-probs of the completion tokens of each row: ``sum_t m_t log p(x_t | x_<t)``.

    Position ``t`` of the logits predicts token ``t + 1``; prompt and padding carry ``m_t = 0``.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1]
    mask = completion_mask[:, 1:].to(torch.float32)
    return (token_logps(logits, input_ids[:, 1:]) * mask).sum(-1)


def next_token_logps(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs ``log p(x_{t+1} | x_≤t)``, shape ``[B, T − 1]``, of the distribution
    ``softmax(logits / temperature)``, and those scaled logits (for entropies). GRPO's per-token
    counterpart of :func:`completion_logps`, built on the same :func:`token_logps`."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1]
    if temperature != 1.0:
        logits = logits / temperature
    return token_logps(logits, input_ids[:, 1:]), logits
