"""What alignflow reads of lm-evaluation-harness beyond ``simple_evaluate`` and ``HFLM``, in one
place (contract: ``tests/test_harness.py``): a task's whole config as the harness builds it from its
YAML file (includes merged), and where a task of the harness's own registry is defined."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

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
