"""Resolve a model source to a checkpoint folder (or hub id) with content fingerprints.

Sources: ``builtin:<name>``, a local folder, an MLflow URI (``runs:/<run id>/model`` or
``models:/<name>@<alias>`` / ``models:/<name>/<version>``), or a Hugging Face model id.
"""

from __future__ import annotations

import json
import shutil
from importlib.metadata import version
from pathlib import Path

import mlflow
from prefect import task
from pydantic import BaseModel, ConfigDict

from infra.core.config import ModelConfig
from infra.core.fingerprints import atomic_directory, code_fingerprint, hash_paths, hash_value
from infra.core.handles import ModelHandle
from infra.core.settings import get_settings
from tasks.mlflow_runs import client
from trainers.catalog import ModelSource
from trainers.models.builtin import builtin_spec, is_builtin, save_builtin_model
from trainers.models.lora import ADAPTER_CONFIG, is_adapter_folder
from trainers.models.tokenizer_identity import TOKENIZER_JSON, tokenizer_identity

# What determines a model's outputs (not training_args.bin or generation_config.json, which name runs and folders).
WEIGHT_PATTERNS = (
    "config.json",
    "adapter_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "pytorch_model*.bin",
)
# Beside a trained adapter: where its base model can be fetched on any machine (an MLflow URI, a
# built-in name or a hub id), for when adapter_config.json's absolute base folder is not there.
BASE_SOURCE = "alignflow_base.json"  # an :class:`AdapterBase`, beside a trained adapter
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


def check_model_folder(path: Path) -> None:
    """A local checkpoint folder has a config, weights and a tokenizer, and its safetensors headers
    parse; errors name the folder and the file (not "Repo id must be in the form…" minutes later).
    A LoRA adapter folder (``adapter_config.json``) is checked for its tokenizer and weights, and
    its base model (``base_model_name_or_path``) must be a model folder or a hub id."""
    if is_adapter_folder(path):
        check_adapter_folder(path)
        return
    if not (path / "config.json").is_file():
        raise ValueError(f"model folder {path}: config.json is missing (not a Hugging Face checkpoint folder?)")
    check_architecture(path)
    weights = [name for name in weight_files(path) if name != "config.json"]
    if not weights:
        raise ValueError(f"model folder {path}: no weights (*.safetensors or pytorch_model*.bin)")
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise ValueError(f"model folder {path}: no tokenizer (tokenizer.json, tokenizer.model or vocab.json)")
    for name in weights:
        if name.endswith(".safetensors"):
            check_safetensors(path / name)


def check_architecture(path: Path) -> None:
    """``config.json`` names a ``model_type`` the installed transformers knows (code shipped with the
    model, ``auto_map``, is not run: ``trust_remote_code`` stays off)."""
    import transformers

    try:
        config = json.loads((path / "config.json").read_text())
        model_type = config["model_type"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"model folder {path}: config.json is not JSON with a model_type") from None
    if model_type not in transformers.CONFIG_MAPPING:
        raise ValueError(
            f"model folder {path}: config.json's model_type {model_type!r} is not an architecture transformers "
            f"{transformers.__version__} knows (a newer transformers, or a model that brings its own code, which "
            "alignflow does not run)"
        )


def check_adapter_folder(path: Path) -> None:
    if not (path / "adapter_model.safetensors").is_file():
        raise ValueError(f"adapter folder {path}: adapter_model.safetensors is missing")
    if not (path / "tokenizer.json").is_file():
        raise ValueError(f"adapter folder {path}: no tokenizer (tokenizer.json); save the tokenizer beside the adapter")
    check_safetensors(path / "adapter_model.safetensors")
    base = json.loads((path / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not base:
        raise ValueError(f"adapter folder {path}: {ADAPTER_CONFIG} names no base_model_name_or_path")
    if Path(base).is_absolute() or Path(base).exists():
        if not Path(base).is_dir():
            raise ValueError(f"adapter folder {path}: its base model folder {base} does not exist")
        check_model_folder(Path(base))


def check_safetensors(file: Path) -> None:
    """The file's header: 8 bytes of length, then that much JSON, within the file."""
    size = file.stat().st_size
    with file.open("rb") as handle:
        head = handle.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        try:
            if not 0 < length <= size - 8:
                raise ValueError
            json.loads(handle.read(length))
        except ValueError:
            raise ValueError(
                f"model folder {file.parent}: {file.name} is corrupt (no valid safetensors header)"
            ) from None


def tokenizer_fingerprint(path: Path) -> str:
    """By what the tokenizer, as transformers loads it, does (:mod:`trainers.models.tokenizer_identity`), so
    that ``save_pretrained`` round trips keep it; a tokenizer without ``tokenizer.json``
    (sentencepiece only) by its files. Loading a tokenizer imports transformers and torch: the value
    is kept under ``cache/tokenizers/``, keyed by the files loading reads and transformers' version,
    so that a run that finds every result cached loads none."""
    if not (path / TOKENIZER_JSON).is_file():
        return hash_paths(path, TOKENIZER_FILES)
    read = hash_paths(path, [*TOKENIZER_FILES, "config.json"])  # config.json: its model type picks the class
    memo = get_settings().tokenizer_cache / hash_value({"files": read, "transformers": version("transformers")})
    if not memo.is_file():
        from trainers.runtime.checkpoints import write_atomically  # torch: loading the tokenizer imports it too

        memo.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(memo, hash_value(tokenizer_identity(path)).encode())
    return memo.read_text()


def checkpoint_handle(
    path: Path, stage: str, mlflow_run_id: str | None = None, source: str | None = None
) -> ModelHandle:
    return ModelHandle(
        path=str(path),
        fingerprint=hash_paths(path),
        tokenizer_fingerprint=tokenizer_fingerprint(path),
        weights_fingerprint=hash_paths(path, weight_files(path)),
        stage=stage,
        mlflow_run_id=mlflow_run_id,
        source=source,
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
    return model_handle(config, stage)


def resolve_scorer(name: str | None, trained: dict[str, ModelHandle]) -> ModelHandle | None:
    """``evaluation.reward_model``: a reward stage's model of this run (``trained``, by stage), or a
    saved reward model's source resolved as a model; None for none."""
    if name is None:
        return None
    if name in trained:
        return trained[name]
    return resolve_model(ModelConfig(source=name), "reward_model")


def resolve_teacher(source: ModelSource | None) -> ModelHandle | None:
    """A distillation stage's teacher (``StageSpec.teacher``) as a handle; None for a stage without one."""
    if source is None:
        return None
    return resolve_model(ModelConfig(source=source.path, revision=source.revision), "teacher")


def model_handle(config: ModelConfig, stage: str = "base") -> ModelHandle:
    """Built-in models are materialised once under the model cache, MLflow models downloaded
    there once; local folders are hashed; hub ids are identified by id and revision (pin a
    commit for an immutable fingerprint). An adapter whose base folder is gone is rebased on the
    base's recorded source (:func:`rebased_adapter`). Every source but a local folder is the
    handle's ``source``: it resolves on any machine."""
    if is_builtin(config.source):
        spec = builtin_spec(config.source, config.seed)  # name, architecture, seed; the module's source has the rest
        identity = hash_value({"spec": spec, "code": code_fingerprint("trainers.models.builtin")})
        target = get_settings().model_cache / f"{config.source.removeprefix('builtin:')}-{identity}"
        if not target.exists():
            with atomic_directory(target) as staging:
                save_builtin_model(config.source, config.seed, staging)
        return checkpoint_handle(target, stage, source=config.source)
    if config.source.startswith(MLFLOW_SCHEMES):
        pinned = pinned_model_uri(config.source)
        return checkpoint_handle(rebased_adapter(download_mlflow_model(pinned)), stage, source=pinned)
    if Path(config.source).expanduser().is_dir():
        folder = rebased_adapter(Path(config.source).expanduser())
        check_model_folder(folder)
        return checkpoint_handle(folder, stage)
    identity = hash_value({"hub": config.source, "revision": config.revision})
    return ModelHandle(
        path=config.source,
        revision=config.revision,
        fingerprint=identity,
        tokenizer_fingerprint=hub_tokenizer_fingerprint(config.source, config.revision) or identity,
        stage=stage,
        source=config.source,
    )


def hub_tokenizer_fingerprint(repo: str, revision: str | None) -> str | None:
    """A hub model's tokenizer by behaviour, as a folder's (:func:`tokenizer_fingerprint`), so that
    it compares equal with its own fine-tunes' tokenizers: its tokenizer files are fetched into the
    Hugging Face cache (or found there, offline). None where they cannot be had."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(repo, revision=revision, allow_patterns=TOKENIZER_FILES))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError):
        return None
    return tokenizer_fingerprint(folder) if (folder / TOKENIZER_JSON).is_file() else None


class AdapterBase(BaseModel):
    """Where a trained adapter's base (the model its stage started from) can be fetched on any
    machine (:data:`BASE_SOURCE`): its ``source`` (an MLflow or hub URI), None where it has none
    (a local folder; a stage that logged no model to MLflow)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: str | None
    revision: str | None = None

    @classmethod
    def read(cls, adapter: Path) -> AdapterBase:
        """The adapter's recorded base; no source where it records none (an adapter saved before it was recorded)."""
        file = adapter / BASE_SOURCE
        if not file.is_file():
            return cls(source=None)
        try:
            return cls.model_validate_json(file.read_text())
        except ValueError as error:
            raise ValueError(f"{file}: not an adapter's recorded base: {error}") from None


def record_adapter_base(adapter: Path, base: ModelHandle) -> None:
    """Write :class:`AdapterBase` beside a trained adapter."""
    (adapter / BASE_SOURCE).write_text(AdapterBase(source=base.source, revision=base.revision).model_dump_json())


def rebased_adapter(path: Path) -> Path:
    """``path`` itself unless it is an adapter whose base folder (``base_model_name_or_path``, an
    absolute path under the state folder where it was trained) is not on this machine; then a
    copy in the model cache whose config names the base fetched from the source recorded at
    training (:data:`BASE_SOURCE`). No recorded source is an error that says what to load instead."""
    if not is_adapter_folder(path):
        return path
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    base = config.get("base_model_name_or_path")
    if not base or not Path(base).is_absolute() or Path(base).is_dir():
        return path  # a folder that is there, a hub id, or nothing (check_adapter_folder names it)
    recorded = AdapterBase.read(path)
    if not recorded.source:
        raise ValueError(
            f"adapter folder {path}: its base model folder {base} does not exist, and the adapter records no "
            f"other source of it ({BASE_SOURCE}: the stage before it logged no model to MLflow, or started from a "
            "local folder); load the stage's merged model (the run's model/ artifact) instead, or restore the base"
        )
    source = model_handle(ModelConfig(source=recorded.source, revision=recorded.revision))
    target = get_settings().model_cache / f"adapter-{hash_value([hash_paths(path), source.fingerprint])}"
    if not target.exists():
        with atomic_directory(target) as staging:
            for file in path.iterdir():
                if file.is_file():
                    shutil.copy2(file, staging / file.name)
            rebased = {**config, "base_model_name_or_path": source.path}
            (staging / ADAPTER_CONFIG).write_text(json.dumps(rebased, indent=2))
    return target
