"""Whether a model's passes run padding-free (``compute.padding_free``), and how its attention keeps
packed rows apart.

Packed rows are kept apart by the attention implementation, never by code of ours: transformers'
masking utilities see rows restart in ``position_ids`` (with no ``attention_mask``) and build a
block-diagonal causal mask for the mask-based implementations, and the flash-attention kernels take
the rows' extents from the same positions (varlen). An architecture that does not build its masks
with those utilities would let packed rows attend to each other: ``auto`` leaves it padded, and
``true`` is refused for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainers.models.transformers_compat import attention_implementation, innermost_model, masks_from_positions
from trainers.sections import PaddingFree

if TYPE_CHECKING:
    import torch

# Implementations whose mask transformers builds per packed row (quadratic in a pack's width).
MASKED = frozenset({"eager", "sdpa", "flex_attention"})
# Implementations that read each row's extent from the positions and attend within it (varlen).
VARLEN = frozenset({"flash_attention_2", "flash_attention_3"})


@dataclass(frozen=True)
class Packing:
    """How a model's padding-free batches are laid out (``trainers.data.packing``): all rows in one pack
    for a varlen kernel; for a mask-based one, packs of the cheapest width when ``pair_cost`` is known
    (one attention pair's FLOPs over one position's through the linear layers), else as wide as the
    batch's longest row."""

    one_pack: bool
    pair_cost: float | None = None
    # ``padding_free: true``: every batch packed; ``auto``: a batch whose packs would save too little of
    # its padded cost stays padded (``trainers.data.packing.packed_batch``)
    always: bool = False


def pair_cost(config: object) -> float | None:
    """A decoder layer's attention FLOPs per (query, key) pair, ``4·d`` (scores and values, ``d`` the
    query width), over its linear FLOPs per position, ``2·h·(d + 2·d_kv + h_o + 3·I)`` (q, k, v, o and a
    gated MLP): from the config's ``hidden_size``, heads and ``intermediate_size``; None without them."""
    hidden, intermediate = getattr(config, "hidden_size", None), getattr(config, "intermediate_size", None)
    heads = getattr(config, "num_attention_heads", None)
    if not (isinstance(hidden, int) and isinstance(intermediate, int) and isinstance(heads, int)):
        return None
    head_dim = getattr(config, "head_dim", None)
    head_dim = head_dim if isinstance(head_dim, int) else hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None)
    query = heads * head_dim
    key_value = (kv_heads if isinstance(kv_heads, int) else heads) * head_dim
    linear = 2 * hidden * (query + 2 * key_value + query + 3 * intermediate)
    return 4 * query / linear


class PaddingFreeError(ValueError):
    """``padding_free: true`` for a model whose attention cannot keep packed rows apart."""


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why ``model``'s attention cannot run packed rows, or None when it can."""
    implementation = attention_implementation(model)
    if implementation not in MASKED | VARLEN:
        return f"its attention implementation {implementation!r} is none of {sorted(MASKED | VARLEN)}"
    if not masks_from_positions(model):
        return f"{type(model).__name__} does not build its attention masks with transformers' masking utilities"
    return None


def packing_for(model: torch.nn.Module, setting: PaddingFree) -> Packing | None:
    """The packing of ``model``'s passes under ``setting``; None: padded batches."""
    if setting is False:
        return None
    reason = unsupported_reason(model)
    if reason is not None:
        if setting is True:
            raise PaddingFreeError(f"compute.padding_free: true, but {reason}; use auto or false")
        return None
    if attention_implementation(model) in VARLEN:
        return Packing(one_pack=True, always=setting is True)
    cost = pair_cost(getattr(innermost_model(model), "config", None))
    return Packing(one_pack=False, pair_cost=cost, always=setting is True)
