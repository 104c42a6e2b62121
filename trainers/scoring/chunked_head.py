"""The LM head and the target log-prob in one chunked pass, for vocabularies whose logits would be
the memory peak (a 151,936-entry vocabulary over a few thousand scored positions is gigabytes).

:class:`HeadTargetLogProbs` takes the last hidden states of the scored positions and the output
projection, and computes ``z = h Wᵀ (+ b)`` a chunk of positions at a time: its log-softmax at the
target (and optionally its entropy and mean), never the whole ``positions × vocabulary`` matrix.
The backward pass recomputes each chunk's logits and accumulates ``∂h = ∂z W`` and ``∂W = ∂zᵀ h``;
``∂z`` is :class:`~trainers.scoring.logprobs.TargetLogProbs`' (its docstring has the formula).
The same idea as the fused linear cross-entropy of Liger-Kernel and of Apple's Cut Cross-Entropy
(Wijmans et al., 2024, arXiv:2411.09009), in plain torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class HeadTargetLogProbs(torch.autograd.Function):
    """``(log p(target), mean_v z_v, H)`` per position of ``softmax(h Wᵀ + b) / temperature``, for
    ``hidden [S, H]``, ``weight [V, H]``, ``targets [S]``; float32 results (float64 for float64
    inputs). ``chunk`` positions per matmul. The head runs in the dtype the forward ran it in (bf16
    under autocast); the softmax in float32."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk, entropy=False, temperature=1.0):
        head_dtype = torch.get_autocast_dtype(hidden.device.type) if torch.is_autocast_enabled() else hidden.dtype
        dtype = torch.promote_types(head_dtype, torch.float32)
        rows = hidden.shape[0]
        normalisers = torch.empty(rows, dtype=dtype, device=hidden.device)
        logps, means = torch.empty_like(normalisers), torch.empty_like(normalisers)
        entropies = torch.empty_like(normalisers) if entropy else None
        w, b = weight.to(head_dtype), None if bias is None else bias.to(head_dtype)
        for start in range(0, rows, chunk):
            part = slice(start, start + chunk)
            z = F.linear(hidden[part].to(head_dtype), w, b).to(dtype)
            if temperature != 1.0:
                z.div_(temperature)
            normalisers[part] = z.logsumexp(-1)
            logps[part] = z.gather(-1, targets[part, None]).squeeze(-1) - normalisers[part]
            means[part] = z.mean(-1)
            if entropies is not None:
                log_probs = z.sub_(normalisers[part, None])
                entropies[part] = log_probs.exp().mul_(log_probs).sum(-1).neg_()
        ctx.save_for_backward(hidden, weight, bias, targets, normalisers, entropies)
        ctx.chunk, ctx.temperature, ctx.head_dtype = chunk, temperature, head_dtype
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(means)
        return logps, means, entropies

    @staticmethod
    def backward(ctx, grad_logps, grad_means, grad_entropy):
        if grad_logps is None and grad_entropy is None:
            return None, None, None, None, None, None, None
        hidden, weight, bias, targets, normalisers, entropies = ctx.saved_tensors
        head_dtype, temperature = ctx.head_dtype, ctx.temperature
        w, b = weight.to(head_dtype), None if bias is None else bias.to(head_dtype)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=normalisers.dtype, device=weight.device)
        grad_bias = None if bias is None else torch.zeros(bias.shape, dtype=normalisers.dtype, device=bias.device)
        for start in range(0, hidden.shape[0], ctx.chunk):
            part = slice(start, start + ctx.chunk)
            h = hidden[part].to(head_dtype)
            z = F.linear(h, w, b).to(normalisers.dtype)
            if temperature != 1.0:
                z.div_(temperature)
            log_probs = z.sub_(normalisers[part, None])
            probs = log_probs.exp()
            # ∂/∂z_v = g (1[v = target] − p_v) − g_H p_v (log p_v + H)
            dz = torch.zeros_like(probs)
            if grad_entropy is not None:
                dz.sub_(probs * (log_probs + entropies[part, None]) * grad_entropy[part, None])
            if grad_logps is not None:
                dz.sub_(probs * grad_logps[part, None])
                dz.scatter_add_(-1, targets[part, None], grad_logps[part, None])
            if temperature != 1.0:
                dz.div_(temperature)
            grad_hidden[part] = (dz.to(head_dtype) @ w).to(hidden.dtype)
            grad_weight.add_(dz.T @ h.to(dz.dtype))
            if grad_bias is not None:
                grad_bias.add_(dz.sum(0))
        grad_weight = grad_weight.to(weight.dtype)
        grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None
