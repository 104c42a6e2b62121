"""The small, serializable references that pass between tasks (never models or tensors)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class Ref(BaseModel):
    model_config = ConfigDict(frozen=True)


class ModelRef(Ref):
    path: str
    fingerprint: str  # every file of the checkpoint
    tokenizer_fingerprint: str
    stage: str
    revision: str | None = None
    mlflow_run_id: str | None = None
    weights_fingerprint: str | None = None  # config and weight files only (local checkpoints)


class PreparedData(Ref):
    path: str
    fingerprint: str
    rows: dict[str, int]
    dropped: dict[str, int]
    token_fingerprints: dict[str, str]  # split -> digest of its token ids
    truncation: dict[str, Any]  # max_length, max_prompt_length, mode


class RefLogps(Ref):
    """An entry of the reference log-prob cache, with what it takes to rebuild it."""

    key: str
    root: str
    data: PreparedData
    reference: ModelRef
    batch_size: int

    @property
    def path(self) -> str:
        return f"{self.root}/{self.key}"

    @property
    def reference_fingerprint(self) -> str:
        return self.reference.fingerprint
