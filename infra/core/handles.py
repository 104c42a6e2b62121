"""Handles: the small, serializable values that pass between tasks, each a path or URI plus
content fingerprints (never models or tensors).

Paths below the state folder are stored relative to it (``$ALIGNFLOW_HOME/outputs/…`` in their
JSON form: Prefect's cached results, ``model.json``) and resolved against the state folder of the
process that reads them: a copied state folder uses its own models, never the original's. In
memory a path is always the resolved one.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, PlainSerializer

from infra.core.config.compute import ComputeConfig
from infra.core.settings import get_settings

HOME = "$ALIGNFLOW_HOME"


def resolve_home(value: str) -> str:
    """``$ALIGNFLOW_HOME/x`` -> ``<state folder>/x``; anything else (other folders, hub ids, URLs) unchanged."""
    if isinstance(value, str) and (value == HOME or value.startswith(HOME + "/")):
        return str(get_settings().root) + value.removeprefix(HOME)
    return value


def relative_to_home(value: str) -> str:
    """``<state folder>/x`` -> ``$ALIGNFLOW_HOME/x``; anything else unchanged."""
    root = str(get_settings().root)
    return HOME + value.removeprefix(root) if value == root or value.startswith(root + "/") else value


# A location that is a state-folder path in memory and state-folder-relative when serialized to JSON.
Location = Annotated[str, BeforeValidator(resolve_home), PlainSerializer(relative_to_home, when_used="json")]


class Handle(BaseModel):
    model_config = ConfigDict(frozen=True)


class ModelHandle(Handle):
    """A model checkpoint folder (or hub id) and its fingerprints."""

    path: Location
    fingerprint: str  # every file of the checkpoint
    tokenizer_fingerprint: str
    stage: str
    revision: str | None = None
    mlflow_run_id: str | None = None
    weights_fingerprint: str | None = None  # config and weight files only (local checkpoints)
    source: str | None = None  # where any machine fetches it: a built-in name, hub id or MLflow URI


class PreparedData(Handle):
    """The prepared (tokenized) splits of an experiment's data."""

    path: Location
    fingerprint: str
    rows: dict[str, int]
    dropped: dict[str, int]  # split -> rows dropped by truncation
    token_fingerprints: dict[str, str]  # split -> digest of its token ids
    truncation: dict[str, Any]  # max_length, max_prompt_length, mode
    truncated_prompts: dict[str, int] = {}  # split -> kept rows whose prompt was cut
    truncated_completions: dict[str, int] = {}  # split -> kept rows with a completion cut
    context: int | None = None  # the model's maximum positions, as preparation read them (None: unknown)
    # ``data.chat_template``'s text, when it overrides the tokenizer's: every tokenizer loaded for a stage
    # or an evaluation of this data gets it (its end-of-turn stops generation; trained models save it)
    chat_template: str | None = None


class ReferenceLogps(Handle):
    """An entry of the reference log-prob cache (log-probs of the preference pairs, or of another
    view of the data, under the reference model), with what it takes to rebuild it."""

    key: str
    root: Location
    data: PreparedData
    reference: ModelHandle
    batch_size: int
    dtype: str = "float32"  # the reference forward's (part of the key)
    # where it is computed: the CPU or the GPU, and over how many processes (``compute.num_processes``)
    compute: ComputeConfig = ComputeConfig()  # noqa: RUF009 (frozen)
    view: str = "pairs"  # what is scored: ``trainers.scoring.reference_views`` (part of the key)
    plugins: tuple[str, ...] = ()  # the config's, which a launched pass imports first (its view may be theirs)

    @property
    def path(self) -> str:
        return f"{self.root}/{self.key}"

    @property
    def reference_fingerprint(self) -> str:
        return self.reference.fingerprint
