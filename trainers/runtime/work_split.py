"""Work split over the processes of a launch, by whole batches, and gathered back in order.

Sharding whole batches (not rows) keeps every batch exactly what one process would form, same
rows and same padding, so a sharded pass gives bit-identical results. ``state`` is accelerate's
``PartialState`` (or None: one process, nothing split).
"""

from __future__ import annotations

from typing import Any, Sequence, TypeVar

Item = TypeVar("Item")


def batches_of(rows: Sequence[Item], batch_size: int) -> list[list[Item]]:
    """``rows`` in consecutive batches of ``batch_size`` (the last one shorter)."""
    return [list(rows[start : start + batch_size]) for start in range(0, len(rows), batch_size)]


def shard_bounds(num_items: int, num_processes: int, index: int) -> tuple[int, int]:
    """Process ``index``'s contiguous share ``[start, end)`` of ``num_items``, as accelerate's
    ``split_between_processes`` cuts a list: ``q = n // P`` each, the first ``n mod P`` one more."""
    share, extra = divmod(num_items, num_processes)
    start = index * share + min(index, extra)
    return start, start + share + (index < extra)


def local_shard(items: list[Item], state: Any | None) -> tuple[int, list[Item]]:
    """The index of this process's first item and its items (all of them without ``state``)."""
    if state is None or state.num_processes == 1:
        return 0, items
    start, end = shard_bounds(len(items), state.num_processes, state.process_index)
    with state.split_between_processes(items) as mine:
        if list(mine) != items[start:end]:
            raise RuntimeError("accelerate split the work other than shard_bounds says")  # a changed library
        return start, list(mine)


def gather_shards(local: list[Item], state: Any | None) -> list[Item]:
    """Every process's ``local`` list, concatenated in process order (the items in their original order)."""
    if state is None or state.num_processes == 1:
        return local
    from accelerate.utils import gather_object

    return gather_object(local)


def from_first(value: Item | None, state: Any | None) -> Item:
    """The first process's ``value`` on every process (the others pass None)."""
    if state is None or state.num_processes == 1:
        if value is None:
            raise ValueError("one process: its value is the value")
        return value
    from accelerate.utils import broadcast_object_list

    (first,) = broadcast_object_list([value], from_process=0)
    return first
