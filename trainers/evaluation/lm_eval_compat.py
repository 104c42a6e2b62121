"""What alignflow reads of lm-evaluation-harness beyond ``simple_evaluate`` and ``HFLM``, in one
place (contract: ``tests/test_harness.py``): a task's whole config as the harness builds it from its
YAML file (includes merged), where a task of the harness's own registry is defined, and its HF
wrapper over the processes of a launch. Its vLLM half, which imports vLLM, is
:mod:`trainers.evaluation.lm_eval_vllm`."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import torch
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from lm_eval.tasks._yaml_loader import load_yaml


def task_yaml(path: Path, resolve_functions: bool) -> dict[str, Any]:
    """The task config of the YAML file ``path``, its ``include`` files merged under it; with
    ``resolve_functions`` its ``!function`` tags are imported (what the harness runs), else left as
    their text (what a fingerprint hashes)."""
    return load_yaml(path, resolve_func=resolve_functions)


@cache
def registry() -> TaskManager:
    """The harness's task registry (indexing its task files takes seconds: once per process)."""
    return TaskManager()


def registered_task_file(name: str) -> Path | None:
    """The YAML file that defines the harness's registered task ``name``; None where it has none
    (a group, a tag, a Python task, or no such name)."""
    entry = registry().task_index.get(name)
    if entry is None or entry.yaml_path is None or entry.kind.name != "TASK":
        return None
    return Path(entry.yaml_path)


class LaunchShards:
    """What the harness's evaluator asks of a model wrapper (``lm_eval.api.model.LM``'s methods) to
    shard its requests over the processes of a launch, accelerate's ``PartialState`` ``state`` (with
    ``torch.distributed`` set up): the rank, the size, gathers (of tensors, of the results) and a
    barrier. The harness shards only a model it loads itself under ``accelerate launch``; alignflow's
    wrappers hold a model (or an engine) it loaded. ``state`` None: one process."""

    state: Any

    @property
    def rank(self) -> int:
        return 0 if self.state is None else self.state.process_index

    @property
    def world_size(self) -> int:
        return 1 if self.state is None else self.state.num_processes

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = [torch.zeros_like(tensor) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, tensor)
        return torch.cat([part.reshape(-1) for part in parts])

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        if self.world_size == 1:
            return [obj]
        gathered = [None] * self.world_size if self.rank == dst else None
        torch.distributed.gather_object(obj, gathered, dst=dst)
        return gathered

    def barrier(self) -> None:
        self.state.wait_for_everyone()


class ShardedHFLM(LaunchShards, HFLM):
    """The harness's HF wrapper around a model instance, its requests sharded over ``state``'s processes."""

    def __init__(self, state: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.state = state


def harness_lm(model: Any, tokenizer: Any, batch_size: int, state: Any | None) -> HFLM:
    """The harness's HF wrapper around ``model``: over the processes of ``state`` where it has several."""
    if state is None or state.num_processes == 1:
        return HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    return ShardedHFLM(state, pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
