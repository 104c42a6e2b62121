"""Dataset preparation: load, validate, tokenize, truncate and save every split as Arrow."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import datasets
from prefect import get_run_logger, task

from infra.core.config import DataConfig, DatasetSource
from infra.core.fingerprints import atomic_directory, code_fingerprint, hash_paths, hash_token_ids, hash_value
from infra.core.handles import ModelHandle, PreparedData
from infra.core.settings import get_settings
from trainers.data import (
    SPLIT_FIELDS,
    Truncation,
    load_rows,
    mixing_rng,
    normalize_rows,
    select_rows,
    tokenize_rows,
    validate_rows,
)
from trainers.synthetic import AdditionTask, generate_addition

MANIFEST = "manifest.json"


def source_list(value: DatasetSource | list[DatasetSource] | None) -> list[DatasetSource]:
    """A split's sources: none, one, or a list (mixed)."""
    return [] if value is None else list(value) if isinstance(value, list) else [value]


def source_identity(source: DatasetSource) -> dict:
    """What identifies a source's content: the bytes of a local file or ``save_to_disk`` folder,
    else name and revision; plus the options that change the rows taken from it (columns, mixing)."""
    path = Path(source.path)
    options = source.model_dump(exclude={"path"})
    if path.is_file():
        return {"file": path.name, "sha256": hash_paths(path.parent, [path.name]), **options}
    if path.is_dir():
        return {"folder": path.name, "sha256": hash_paths(path), **options}
    return source.model_dump()


def resolve_chat_template(value: str | None) -> str | None:
    """``data.chat_template``: the text of a file, else the value itself, a Jinja template."""
    if value is None:
        return None
    if "{" not in value:
        path = Path(value).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"data.chat_template: no such file {value!r} (and not a Jinja template)")
        return path.read_text(encoding="utf-8")
    return value


def data_fingerprint(config: DataConfig, tokenizer: ModelHandle) -> str:
    sources = {split: [source_identity(s) for s in source_list(getattr(config, split))] for split in SPLIT_FIELDS}
    return hash_value(
        {
            # this module and the trainers code it runs: loading, validating, tokenizing, the built-in task
            "code": code_fingerprint(__name__),
            "builtin": config.builtin.model_dump() if config.builtin else None,
            "sources": {split: identities for split, identities in sources.items() if identities},
            "truncation": [config.max_length, config.max_prompt_length, config.truncation_mode],
            "chat_template": resolve_chat_template(config.chat_template),
            "seed": config.seed,
            "tokenizer": tokenizer.tokenizer_fingerprint,
        }
    )


def raw_splits(config: DataConfig) -> dict[str, list[tuple[str, list[dict], DatasetSource | None]]]:
    """``split -> [(source name, rows, source)]``: explicit sources win over the built-in task."""
    splits: dict[str, list[tuple[str, list[dict], DatasetSource | None]]] = {}
    if config.builtin is not None:
        generated = generate_addition(AdditionTask(**config.builtin.model_dump()))
        splits = {split: [(f"builtin:addition/{split}", rows, None)] for split, rows in generated.items()}
    for split in SPLIT_FIELDS:
        sources = source_list(getattr(config, split))
        if sources:
            splits[split] = [(s.path, load_rows(s.path, s.name, s.split, s.revision, s.columns), s) for s in sources]
    return splits


def prepare_split(parts, split: str, tokenizer, truncation: Truncation, seed: int) -> tuple[list[dict], dict]:
    """Normalize, validate and tokenize each source of a split, then take each source's share
    (``weight`` / ``num_samples``, seeded) of its kept rows, in source order. Returns the rows and
    the split's report: dropped and truncated prompts (counted on the rows read) and per source counts."""
    rows, report = [], {"dropped": 0, "truncated_prompts": 0, "unterminated": 0, "sources": []}
    for index, (name, raw, source) in enumerate(parts):
        normalized = normalize_rows(raw, split, name)
        validate_rows(normalized, SPLIT_FIELDS[split], name)
        result = tokenize_rows(normalized, split, tokenizer, truncation, name)
        if not result.rows:
            raise ValueError(
                f"{name}: every row of split {split!r} was dropped by truncation "
                f"(max_length={truncation.max_length}, max_prompt_length={truncation.max_prompt_length}, "
                f"mode={truncation.mode})"
            )
        weight, num_samples = (source.weight, source.num_samples) if source else (None, None)
        used = select_rows(result.rows, weight, num_samples, mixing_rng(seed, split, index))
        rows += used
        report["dropped"] += result.dropped
        report["truncated_prompts"] += result.truncated_prompts
        report["unterminated"] += result.unterminated
        report["sources"].append(
            {
                "source": name,
                "rows_read": len(raw),
                "dropped": result.dropped,
                "truncated_prompts": result.truncated_prompts,
                "rows_used": len(used),
            }
        )
    if not rows:
        raise ValueError(f"split {split!r}: the sources' weight / num_samples select no rows")
    return rows, report


# The content-addressed folder is the cache, checked on every run, rather than a Prefect cached
# result: a cached result would hand out its path even after the folder was deleted (a cleared
# `cache/`), and reading an existing manifest costs milliseconds.
# dill (used by datasets to fingerprint functions) captures stdout around dis.dis; Prefect's
# print capture would bypass that and log the bytecode listing.
@task(name="prepare-dataset", log_prints=False)
def prepare_dataset(config: DataConfig, tokenizer: ModelHandle) -> PreparedData:
    fingerprint = data_fingerprint(config, tokenizer)
    target = get_settings().data_cache / fingerprint
    if not (target / MANIFEST).exists():
        from trainers.modeling import load_tokenizer  # transformers: only when preparing

        truncation = Truncation(config.max_length, config.max_prompt_length, config.truncation_mode)
        tok = load_tokenizer(tokenizer.path, tokenizer.revision)
        template = resolve_chat_template(config.chat_template)
        if template is not None:
            tok.chat_template = template
        tokenized, reports = {}, {}
        for split, parts in raw_splits(config).items():
            tokenized[split], reports[split] = prepare_split(parts, split, tok, truncation, config.seed)
        splits = datasets.DatasetDict({s: datasets.Dataset.from_list(r) for s, r in tokenized.items()})
        with atomic_directory(target) as staging:
            splits.save_to_disk(staging / "data")
            manifest = {
                "rows": {s: len(r) for s, r in tokenized.items()},
                "dropped": {s: r["dropped"] for s, r in reports.items()},
                "truncated_prompts": {s: r["truncated_prompts"] for s, r in reports.items()},
                "unterminated_completions": {s: r["unterminated"] for s, r in reports.items() if r["unterminated"]},
                "sources": {s: r["sources"] for s, r in reports.items()},
                "truncation": asdict(truncation),
                "token_fingerprints": {s: hash_token_ids(d) for s, d in splits.items()},
            }
            (staging / MANIFEST).write_text(json.dumps(manifest, indent=2))
    manifest = json.loads((target / MANIFEST).read_text())
    truncated = manifest.get("truncated_prompts", {})
    if any(manifest["dropped"].values()):
        get_run_logger().warning("rows dropped by truncation (%s): %s", config.truncation_mode, manifest["dropped"])
    if any(truncated.values()):
        get_run_logger().warning(
            "prompts cut to max_prompt_length=%d (%s): %s", config.max_prompt_length, config.truncation_mode, truncated
        )
    if manifest["unterminated_completions"]:
        get_run_logger().warning(
            "rows whose completion does not end with EOS or a special end-of-turn token: %s of %s. A model "
            "trained on them does not learn where to stop, and generation cannot stop at a plain-text marker: "
            "make the chat template's end-of-turn marker a special token of the tokenizer, or end each turn with "
            "its EOS (docs/data-and-models.md, where generation stops)",
            manifest["unterminated_completions"],
            manifest["rows"],
        )
    return PreparedData(
        path=str(target / "data"),
        fingerprint=fingerprint,
        rows=manifest["rows"],
        dropped=manifest["dropped"],
        truncated_prompts=truncated,
        token_fingerprints=manifest["token_fingerprints"],
        truncation=manifest["truncation"],
    )
