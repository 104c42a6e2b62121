"""Padding-free batches: rows placed one after another in a few packed rows, ``position_ids``
restarting at 0 for each, so that no forward computes a padding token.

The attention implementation keeps the rows apart (:mod:`trainers.models.attention`): a varlen kernel
(flash attention) reads each row's extent from the positions, and the mask-based ones (``sdpa``,
``eager``) get a block-diagonal causal mask that transformers builds from the positions. A mask-based
kernel visits every pair of a pack's positions, so for those the pack width is chosen by cost
(:func:`plan_cheapest`, best-fit decreasing at each width tried), from the longest row to the whole batch.

The plan is pure bookkeeping over row lengths; :class:`PackedBatch` moves tensors into and out of it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

import torch

from trainers.models.attention import Packing


@dataclass(frozen=True)
class PackPlan:
    """Where each row goes: row ``i`` fills ``lengths[i]`` slots of pack ``packs[i]`` from slot
    ``offsets[i]``. Packs are ``width`` slots wide; slots after the last row of a pack are filler."""

    lengths: tuple[int, ...]
    packs: tuple[int, ...]
    offsets: tuple[int, ...]
    count: int
    width: int

    def cost(self, pair_cost: float) -> float:
        """:func:`packs_cost` of these packs."""
        return packs_cost(self.count, self.width, pair_cost)

    def positions(self) -> torch.Tensor:
        """``position_ids`` of the packs, ``[count, width]``: 0, 1, … within each row, and within
        each pack's filler (which forms a sequence of its own, attended by no row)."""
        packs, offsets = torch.tensor(self.packs), torch.tensor(self.offsets)
        ends = torch.zeros(self.count, dtype=torch.long).scatter_reduce(
            0, packs, offsets + torch.tensor(self.lengths), "amax"
        )
        # each slot's sequence starts at the latest start at or before it: the rows' offsets, the filler's end
        starts = torch.zeros(self.count, self.width + 1, dtype=torch.long)
        starts[packs, offsets] = offsets
        starts[torch.arange(self.count), ends] = ends
        slots = torch.arange(self.width)
        return slots - starts[:, : self.width].cummax(1).values


def packs_cost(count: int, width: int, pair_cost: float) -> float:
    """The cost of ``count`` rows of ``width`` positions (packs, or a padded batch's rows): each position
    through the linear layers, and each of the ``width²`` attention pairs ``pair_cost`` of a position."""
    return count * (width + pair_cost * width**2)


def plan_packs(lengths: Sequence[int], width: int | None = None) -> PackPlan:
    """Best-fit decreasing of rows of ``lengths`` into packs of ``width`` slots (default: the longest
    row; a row wider than ``width`` is an error): the longest row first, each into the open pack it
    fills best. Deterministic (ties: the earlier row, the earlier pack); ``O(n log n)``."""
    lengths = tuple(int(n) for n in lengths)
    if not lengths:
        raise ValueError("plan_packs: no rows")
    width = max(lengths) if width is None else width
    if max(lengths) > width:
        raise ValueError(f"plan_packs: a row of {max(lengths)} tokens does not fit packs of {width}")
    free: list[tuple[int, int]] = []  # (slots left, pack), ascending
    packs, offsets = [0] * len(lengths), [0] * len(lengths)
    count = 0
    for row in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        length = lengths[row]
        at = bisect.bisect_left(free, (length, -1))
        if at == len(free):
            left, pack = width, count
            count += 1
        else:
            left, pack = free.pop(at)
        packs[row], offsets[row] = pack, width - left
        bisect.insort(free, (left - length, pack))
    return PackPlan(lengths, tuple(packs), tuple(offsets), count, width)


def plan_cheapest(lengths: Sequence[int], pair_cost: float) -> PackPlan:
    """Of the pack widths ``longest · 2ᵏ`` and the whole batch, the plan that costs least when a pack of
    width ``W`` costs ``W + pair_cost · W²`` (its positions through the linear layers, and its
    ``W²`` attention pairs, each ``pair_cost`` of a position): narrow packs waste least attention on
    pairs across rows, wide ones least filler."""
    lengths = tuple(int(n) for n in lengths)
    total, width = sum(lengths), max(lengths)
    widths = [width]
    while widths[-1] < total:
        widths.append(min(total, 2 * widths[-1]))
    plans = [plan_packs(lengths, w) for w in widths]
    return min(plans, key=lambda plan: plan.cost(pair_cost))


def plan_one_pack(lengths: Sequence[int]) -> PackPlan:
    """Every row in one pack, in order: what a varlen attention kernel takes."""
    lengths = tuple(int(n) for n in lengths)
    offsets = [0]
    for length in lengths[:-1]:
        offsets.append(offsets[-1] + length)
    return PackPlan(lengths, (0,) * len(lengths), tuple(offsets), 1, sum(lengths))


@dataclass(frozen=True)
class PackedBatch:
    """A right- or left-padded batch (each row's tokens contiguous: ``attention_mask`` one run of
    ones) and its packed form. Token ``(row, col)`` of the padded batch is token
    ``(pack[row], col + shift[row])`` of the packs."""

    plan: PackPlan
    pack: torch.Tensor  # [B] the pack of each row
    shift: torch.Tensor  # [B] pack slot − padded column of each row's tokens
    starts: torch.Tensor  # [B] each row's first real column in the padded batch

    @classmethod
    def of(cls, attention_mask: torch.Tensor, packing: Packing) -> PackedBatch:
        """``attention_mask``'s rows laid out as ``packing`` says: in one pack (varlen attention), in the
        cheapest widths by its ``pair_cost`` (:func:`plan_cheapest`), or without one in packs as wide as
        the longest row."""
        mask = attention_mask.bool()
        lengths = mask.sum(1)
        starts = mask.int().argmax(1)
        ends = mask.shape[1] - mask.flip(1).int().argmax(1)
        empty = lengths == 0
        if bool(((ends - starts != lengths) & ~empty).any()):
            row = int(((ends - starts != lengths) & ~empty).nonzero()[0])
            raise ValueError(f"padding-free batch: row {row}'s tokens are not contiguous in its attention_mask")
        if packing.one_pack:
            plan = plan_one_pack(lengths.tolist())
        elif packing.pair_cost is not None:
            plan = plan_cheapest(lengths.tolist(), packing.pair_cost)
        else:
            plan = plan_packs(lengths.tolist())
        device = attention_mask.device
        pack = torch.tensor(plan.packs, device=device)
        shift = torch.tensor(plan.offsets, device=device) - starts
        return cls(plan, pack, shift, starts)

    def scatter(self, values: torch.Tensor, mask: torch.Tensor, fill: int = 0) -> torch.Tensor:
        """``values`` ``[B, T]`` at ``mask``'s tokens, placed in the packs ``[count, width]`` (``fill`` elsewhere)."""
        rows, cols = mask.bool().nonzero(as_tuple=True)
        out = values.new_full((self.plan.count, self.plan.width), fill)
        out[self.pack[rows], cols + self.shift[rows]] = values[rows, cols]
        return out

    def locate(self, rows: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where padded positions ``(rows, cols)`` are in the packs."""
        return self.pack[rows], cols + self.shift[rows]

    def position_ids(self, device: torch.device) -> torch.Tensor:
        return self.plan.positions().to(device)


# Under ``padding_free: auto`` a batch is packed only where its packs cost at most this share of the
# padded batch: below a tenth saved, the bookkeeping (the plan, the scatter, the mask) costs as much.
MOST_PACKED_COST = 0.9


def packed_batch(attention_mask: torch.Tensor, packing: Packing) -> PackedBatch | None:
    """``attention_mask``'s rows packed as ``packing`` says, or None (pass the batch padded) when
    ``packing`` is ``auto``'s, mask-based, and the packs would cost more than ``MOST_PACKED_COST`` of the
    padded batch, both by :func:`plan_cheapest`'s measure (a batch of rows of nearly equal length)."""
    if packing.always or packing.one_pack:
        return PackedBatch.of(attention_mask, packing)
    rows, width = attention_mask.shape
    # Rows filling MOST_PACKED_COST of the slots: no plan can cost less (its packs hold the same tokens,
    # each pack as wide as the longest row at least), so none is made.
    if int(attention_mask.sum()) >= MOST_PACKED_COST * rows * width:
        return None
    packed = PackedBatch.of(attention_mask, packing)
    pair = packing.pair_cost or 0.0
    return packed if packed.plan.cost(pair) <= MOST_PACKED_COST * packs_cost(rows, width, pair) else None


class TokenBudgetBatches(torch.utils.data.Sampler[list[int]]):
    """SFT's packed epochs: batches of row indices whose tokens add up to at most ``budget``, by
    best-fit decreasing over all the rows (:func:`plan_packs`), so every row is in exactly one
    batch. The batches are the same each epoch (their count too, which the Trainer's schedule reads);
    their order is shuffled per epoch (``seed`` and the epoch, :meth:`set_epoch`)."""

    def __init__(self, lengths: Sequence[int], budget: int, seed: int):
        if lengths and max(lengths) > budget:
            row = max(range(len(lengths)), key=lambda i: lengths[i])
            raise ValueError(
                f"sft.batch_tokens: row {row} has {lengths[row]} tokens, more than the budget of {budget}; "
                "raise batch_tokens or cut the rows shorter (data.max_length)"
            )
        plan = plan_packs(lengths, budget)
        self.batches: list[list[int]] = [[] for _ in range(plan.count)]
        for row, pack in enumerate(plan.packs):
            self.batches[pack].append(row)
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        for index in torch.randperm(len(self.batches), generator=generator).tolist():
            yield self.batches[index]
