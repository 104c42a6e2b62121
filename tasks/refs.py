"""The small, serializable references that pass between tasks (never models or tensors)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Ref(BaseModel):
    model_config = ConfigDict(frozen=True)


class ModelRef(Ref):
    path: str
    fingerprint: str
    tokenizer_fingerprint: str
    stage: str
    revision: str | None = None
    mlflow_run_id: str | None = None


class PreparedData(Ref):
    path: str
    fingerprint: str
    rows: dict[str, int]
    dropped: dict[str, int]


class RefLogps(Ref):
    key: str
    path: str
    reference_fingerprint: str
    rows: dict[str, int]
