"""GRPO's data order: each prompt G times in a row, each generation batch repeated.

The Trainer's dataloader yields one *generation batch* per training step: the sampler repeats
that batch ``steps_per_generation × num_iterations`` times, so every step of a generation cycle
receives the same prompts and the trainer generates for them once and serves its buffer.
"""

from __future__ import annotations

from typing import Callable, Iterator, Sized

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from trainers.grpo.layout import GenerationLayout


class RepeatSampler(Sampler[int]):
    """Indices of ``num_rows`` prompts for GRPO, in generation batches.

    Prompts are drawn (shuffled with ``seed + epoch``, or in order) in chunks of
    ``prompts_per_chunk``; an incomplete last chunk is dropped. Each chunk is emitted
    ``repeats`` times, and within it each prompt ``num_generations`` times in a row::

        RepeatSampler(5, num_generations=2, prompts_per_chunk=2, repeats=2, shuffle=False)
        -> 0 0 1 1 | 0 0 1 1 | 2 2 3 3 | 2 2 3 3      (prompt 4 is dropped)

    Under accelerate's sharding (``BatchSamplerShard``: process p takes batches p, p + n, …)
    with a per-process batch of ``prompts_per_chunk × num_generations / n`` indices, process p
    gets the p-th part of every chunk, every repeat: disjoint, and together complete.
    """

    def __init__(
        self,
        num_rows: int,
        *,
        num_generations: int,
        prompts_per_chunk: int,
        repeats: int = 1,
        shuffle: bool = True,
        seed: int = 0,
    ):
        if num_rows < prompts_per_chunk:
            raise ValueError(f"{num_rows} prompts cannot fill one generation batch of {prompts_per_chunk} prompts")
        self.num_rows = num_rows
        self.num_generations = num_generations
        self.prompts_per_chunk = prompts_per_chunk
        self.repeats = repeats
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def chunks(self) -> list[list[int]]:
        if self.shuffle:
            order = torch.randperm(
                self.num_rows, generator=torch.Generator().manual_seed(self.seed + self.epoch)
            ).tolist()
        else:
            order = list(range(self.num_rows))
        usable = len(order) - len(order) % self.prompts_per_chunk
        return [order[start : start + self.prompts_per_chunk] for start in range(0, usable, self.prompts_per_chunk)]

    def __iter__(self) -> Iterator[int]:
        for chunk in self.chunks():
            for _ in range(self.repeats):
                for index in chunk:
                    yield from [index] * self.num_generations

    def __len__(self) -> int:
        return (self.num_rows // self.prompts_per_chunk) * self.prompts_per_chunk * self.num_generations * self.repeats


def generation_dataloader(
    dataset: Dataset,
    layout: GenerationLayout,
    *,
    num_iterations: int,
    seed: int,
    collate_fn: Callable,
    shuffle: bool = True,
    **loader_options,
) -> DataLoader:
    """One batch = one process's part of a generation batch (per-device batch × steps per
    generation rows), repeated for every step and iteration that consumes it. Shard it with
    ``accelerator.prepare``."""
    if not isinstance(dataset, Sized):
        raise TypeError(f"GRPO samples prompts by index: it needs a map-style dataset, not a {type(dataset).__name__}")
    sampler = RepeatSampler(
        len(dataset),
        num_generations=layout.num_generations,
        prompts_per_chunk=layout.prompts_per_generation,
        repeats=layout.steps_per_generation * num_iterations,
        shuffle=shuffle,
        seed=seed,
    )
    return DataLoader(
        dataset,
        batch_size=layout.per_device_generation_batch_size,
        sampler=sampler,
        collate_fn=collate_fn,
        **loader_options,
    )
