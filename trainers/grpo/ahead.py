"""Asynchronous GRPO (``max_staleness: k ≥ 1``): generation batches sampled ahead by a vLLM server
while the trainer trains.

At the start of generation round ``g`` the trainer takes batch ``g``, sampled ahead; waits until
the server has finished what it was asked (a weight push must not land in the middle of a
generation); pushes the policy's weights as they are now; and asks for the batches up to ``g + k``
that are not asked for yet. The server samples them on its own devices while the trainer trains on
batch ``g``, so batch ``g + k`` comes from the weights of round ``g``: at most ``k`` rounds old when
it is trained on. Its samples carry that version (``staleness/steps_*``); the trainer computes
π_old of each batch itself when it takes it, and the importance-sampling correction
(``vllm_importance_sampling_cap``) weighs the gap to the engine's sampling policy.

Which prompts come next is the sampler's order (:class:`~trainers.grpo.samplers.RepeatSampler`, the
current epoch's chunks, one training process): a batch is asked for only within the epoch, and one
is taken only when its prompts are the ones the trainer's dataloader gives for the round, so a
round whose batch was not sampled ahead (the first, the first of an epoch, the first after a
resume: in-flight batches are not checkpointed) is sampled there and then, as ``max_staleness: 0`` does."""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from trainers.grpo.rollouts import EngineBackend, Rollouts


@dataclass(frozen=True)
class Asked:
    """A generation batch asked of the engine: its prompts and the rollouts to come."""

    prompts: list[list[int]]
    rollouts: Future[Rollouts]


class AheadSampler:
    """Up to ``depth`` generation batches asked of ``backend``'s engine ahead of the trainer, one at a
    time by one worker thread (the engine's HTTP calls only: no tensor of the trainer's is read there).
    ``taken`` counts the batches the trainer took from it (the others it sampled in the round)."""

    def __init__(self, backend: EngineBackend, depth: int):
        self.backend, self.depth = backend, depth
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="alignflow-rollouts")
        self.asked: deque[Asked] = deque()
        self.taken = 0

    def take(self, prompts: list[list[int]]) -> Rollouts | None:
        """The batch asked for ``prompts`` if it is the next one; else None, and nothing stays asked."""
        if self.asked and self.asked[0].prompts == prompts:
            self.taken += 1
            return self.asked.popleft().rollouts.result()
        self.discard()
        return None

    def settle(self) -> None:
        """Wait until the engine has answered every batch asked (it is idle: weights may be pushed)."""
        for asked in self.asked:
            asked.rollouts.result()

    def ask(self, upcoming: list[list[list[int]]], seeds: Callable[[int], list[int]]) -> None:
        """Ask for the batches of ``upcoming`` (the prompts of the next batches, in order; ``seeds(i)``
        those of ``upcoming[i]``) that are not asked for yet, up to ``depth`` in all."""
        for index in range(len(self.asked), min(self.depth, len(upcoming))):
            future = self.worker.submit(self.backend.sample_synced, upcoming[index], seeds(index))
            self.asked.append(Asked(upcoming[index], future))

    def discard(self) -> None:
        """Every batch asked answered (the engine idle), none kept; the worker stays for what comes next."""
        self.settle()
        self.asked.clear()
