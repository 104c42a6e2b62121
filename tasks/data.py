"""Dataset preparation: load, validate, tokenize, truncate and save every split as Arrow."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import datasets
from prefect import get_run_logger, task

from infra.config import DataConfig, DatasetSource
from infra.settings import get_settings
from tasks.fingerprints import atomic_directory, code_fingerprint, hash_paths, hash_token_ids, hash_value
from tasks.handles import ModelHandle, PreparedData
from trainers.data import SPLIT_FIELDS, Truncation, load_rows, tokenize_split, validate_rows
from trainers.modeling import load_tokenizer
from trainers.synthetic import AdditionTask, generate_addition

MANIFEST = "manifest.json"


def source_identity(source: DatasetSource) -> dict:
    """What identifies a source's content: the bytes of a local file, else name and revision."""
    path = Path(source.path)
    if path.is_file():
        return {"file": path.name, "sha256": hash_paths(path.parent, [path.name])}
    return source.model_dump()


def data_fingerprint(config: DataConfig, tokenizer: ModelHandle) -> str:
    sources = {split: source_identity(s) for split in SPLIT_FIELDS if (s := getattr(config, split)) is not None}
    return hash_value(
        {
            # this module and the trainers code it runs: loading, validating, tokenizing, the built-in task
            "code": code_fingerprint(__name__),
            "builtin": config.builtin.model_dump() if config.builtin else None,
            "sources": sources,
            "truncation": [config.max_length, config.max_prompt_length, config.truncation_mode],
            "tokenizer": tokenizer.tokenizer_fingerprint,
        }
    )


def data_cache_key(context, parameters) -> str:
    return "prepare-" + data_fingerprint(parameters["config"], parameters["tokenizer"])


def raw_splits(config: DataConfig) -> dict[str, tuple[str, list[dict]]]:
    """``split -> (source name, rows)``: explicit sources win over the built-in task."""
    splits: dict[str, tuple[str, list[dict]]] = {}
    if config.builtin is not None:
        generated = generate_addition(AdditionTask(**config.builtin.model_dump()))
        splits = {split: (f"builtin:addition/{split}", rows) for split, rows in generated.items()}
    for split in SPLIT_FIELDS:
        source = getattr(config, split)
        if source is not None:
            splits[split] = (source.path, load_rows(source.path, source.name, source.split, source.revision))
    return splits


# dill (used by datasets to fingerprint functions) captures stdout around dis.dis; Prefect's
# print capture would bypass that and log the bytecode listing.
@task(name="prepare-dataset", cache_key_fn=data_cache_key, persist_result=True, log_prints=False)
def prepare_dataset(config: DataConfig, tokenizer: ModelHandle) -> PreparedData:
    fingerprint = data_fingerprint(config, tokenizer)
    target = get_settings().data_cache / fingerprint
    if not (target / MANIFEST).exists():
        truncation = Truncation(config.max_length, config.max_prompt_length, config.truncation_mode)
        tok = load_tokenizer(tokenizer.path, tokenizer.revision)
        tokenized, dropped = {}, {}
        for split, (source, rows) in raw_splits(config).items():
            validate_rows(rows, SPLIT_FIELDS[split], source)
            tokenized[split], dropped[split] = tokenize_split(rows, split, tok, truncation)
            if not tokenized[split]:
                raise ValueError(f"{source}: every row of split {split!r} was dropped by truncation")
        splits = datasets.DatasetDict({s: datasets.Dataset.from_list(r) for s, r in tokenized.items()})
        with atomic_directory(target) as staging:
            splits.save_to_disk(staging / "data")
            manifest = {
                "rows": {s: len(r) for s, r in tokenized.items()},
                "dropped": dropped,
                "truncation": asdict(truncation),
                "token_fingerprints": {s: hash_token_ids(d) for s, d in splits.items()},
            }
            (staging / MANIFEST).write_text(json.dumps(manifest, indent=2))
    manifest = json.loads((target / MANIFEST).read_text())
    if any(manifest["dropped"].values()):
        get_run_logger().warning("pairs dropped because truncation left no completion: %s", manifest["dropped"])
    return PreparedData(
        path=str(target / "data"),
        fingerprint=fingerprint,
        rows=manifest["rows"],
        dropped=manifest["dropped"],
        token_fingerprints=manifest["token_fingerprints"],
        truncation=manifest["truncation"],
    )
