"""Resolve the configured base model to a checkpoint folder (or hub id) with fingerprints."""

from __future__ import annotations

from pathlib import Path

from prefect import task

from infra.config import ModelConfig
from infra.settings import get_settings
from tasks.fingerprints import atomic_directory, hash_paths, hash_value
from tasks.refs import ModelRef
from trainers.builtin_model import is_builtin, save_builtin_model

# What determines a model's outputs (not training_args.bin or generation_config.json, which name runs and folders).
WEIGHT_PATTERNS = ("config.json", "*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin")
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "tokenizer.model"]


def weight_files(path: Path) -> list[str]:
    return sorted({p.name for pattern in WEIGHT_PATTERNS for p in path.glob(pattern) if p.is_file()})


def checkpoint_ref(path: Path, stage: str, mlflow_run_id: str | None = None) -> ModelRef:
    return ModelRef(
        path=str(path),
        fingerprint=hash_paths(path),
        tokenizer_fingerprint=hash_paths(path, TOKENIZER_FILES),
        weights_fingerprint=hash_paths(path, weight_files(path)),
        stage=stage,
        mlflow_run_id=mlflow_run_id,
    )


@task(name="resolve-model")
def resolve_model(config: ModelConfig) -> ModelRef:
    """Built-in models are materialised once under the model cache; local folders are hashed;
    hub ids are identified by id and revision (pin a commit for an immutable fingerprint)."""
    if is_builtin(config.source):
        name = config.source.removeprefix("builtin:")
        target = get_settings().model_cache / f"{name}-seed{config.seed}"
        if not target.exists():
            with atomic_directory(target) as staging:
                save_builtin_model(config.source, config.seed, staging)
        return checkpoint_ref(target, "base")
    if Path(config.source).is_dir():
        return checkpoint_ref(Path(config.source), "base")
    identity = hash_value({"hub": config.source, "revision": config.revision})
    return ModelRef(path=config.source, revision=config.revision, fingerprint=identity, tokenizer_fingerprint=identity, stage="base")
