"""Resolve a model source to a checkpoint folder (or hub id) with content fingerprints.

Sources: ``builtin:<name>``, a local folder, an MLflow URI (``runs:/<run id>/model`` or
``models:/<name>@<alias>`` / ``models:/<name>/<version>``), or a Hugging Face model id.
"""

from __future__ import annotations

from pathlib import Path

import mlflow
from prefect import task

from infra.config import ModelConfig
from infra.settings import get_settings
from tasks.fingerprints import atomic_directory, code_fingerprint, hash_paths, hash_value
from tasks.handles import ModelHandle
from tasks.tracking import client
from trainers.builtin_model import builtin_spec, is_builtin, save_builtin_model

# What determines a model's outputs (not training_args.bin or generation_config.json, which name runs and folders).
WEIGHT_PATTERNS = ("config.json", "*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin")
TOKENIZER_FILES = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
]
MLFLOW_SCHEMES = ("runs:/", "models:/")


def weight_files(path: Path) -> list[str]:
    return sorted({p.name for pattern in WEIGHT_PATTERNS for p in path.glob(pattern) if p.is_file()})


def checkpoint_handle(path: Path, stage: str, mlflow_run_id: str | None = None) -> ModelHandle:
    return ModelHandle(
        path=str(path),
        fingerprint=hash_paths(path),
        tokenizer_fingerprint=hash_paths(path, TOKENIZER_FILES),
        weights_fingerprint=hash_paths(path, weight_files(path)),
        stage=stage,
        mlflow_run_id=mlflow_run_id,
    )


def pinned_model_uri(uri: str) -> str:
    """``models:/name@alias`` → ``models:/name/<version>``: aliases move, versions do not."""
    if uri.startswith("models:/") and "@" in uri:
        name, alias = uri.removeprefix("models:/").split("@", 1)
        return f"models:/{name}/{client().get_model_version_by_alias(name, alias).version}"
    return uri


def download_mlflow_model(uri: str) -> Path:
    """Download an MLflow model folder once into the model cache, keyed by the pinned URI."""
    pinned = pinned_model_uri(uri)
    target = get_settings().model_cache / f"mlflow-{hash_value(pinned)}"
    if not target.exists():
        with atomic_directory(target) as staging:
            local = Path(
                mlflow.artifacts.download_artifacts(
                    pinned, dst_path=str(staging / "download"), tracking_uri=get_settings().mlflow_tracking_uri
                )
            )
            local.rename(staging / "model")
    return target / "model"


@task(name="resolve-model")
def resolve_model(config: ModelConfig, stage: str = "base") -> ModelHandle:
    """Built-in models are materialised once under the model cache, MLflow models downloaded
    there once; local folders are hashed; hub ids are identified by id and revision (pin a
    commit for an immutable fingerprint)."""
    if is_builtin(config.source):
        spec = builtin_spec(config.source, config.seed)  # name, architecture, seed; the module's source has the rest
        identity = hash_value({"spec": spec, "code": code_fingerprint("trainers.builtin_model")})
        target = get_settings().model_cache / f"{config.source.removeprefix('builtin:')}-{identity}"
        if not target.exists():
            with atomic_directory(target) as staging:
                save_builtin_model(config.source, config.seed, staging)
        return checkpoint_handle(target, stage)
    if config.source.startswith(MLFLOW_SCHEMES):
        return checkpoint_handle(download_mlflow_model(config.source), stage)
    if Path(config.source).is_dir():
        return checkpoint_handle(Path(config.source), stage)
    identity = hash_value({"hub": config.source, "revision": config.revision})
    return ModelHandle(
        path=config.source, revision=config.revision, fingerprint=identity, tokenizer_fingerprint=identity, stage=stage
    )
