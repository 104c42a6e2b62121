"""Handles: the small, serializable values that pass between tasks, each a path or URI plus
content fingerprints (never models or tensors)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class Handle(BaseModel):
    model_config = ConfigDict(frozen=True)


class ModelHandle(Handle):
    """A model checkpoint folder (or hub id) and its fingerprints."""

    path: str
    fingerprint: str  # every file of the checkpoint
    tokenizer_fingerprint: str
    stage: str
    revision: str | None = None
    mlflow_run_id: str | None = None
    weights_fingerprint: str | None = None  # config and weight files only (local checkpoints)


class PreparedData(Handle):
    """The prepared (tokenized) splits of an experiment's data."""

    path: str
    fingerprint: str
    rows: dict[str, int]
    dropped: dict[str, int]  # split -> rows dropped by truncation
    token_fingerprints: dict[str, str]  # split -> digest of its token ids
    truncation: dict[str, Any]  # max_length, max_prompt_length, mode
    truncated_prompts: dict[str, int] = {}  # split -> kept rows whose prompt was cut


class ReferenceLogps(Handle):
    """An entry of the reference log-prob cache (log-probs of the preference pairs under the
    reference model), with what it takes to rebuild it."""

    key: str
    root: str
    data: PreparedData
    reference: ModelHandle
    batch_size: int
    dtype: str = "float32"  # the reference forward's (part of the key)
    cpu: bool = False  # computed on the CPU even where there is a GPU (``compute.cpu``)

    @property
    def path(self) -> str:
        return f"{self.root}/{self.key}"

    @property
    def reference_fingerprint(self) -> str:
        return self.reference.fingerprint
