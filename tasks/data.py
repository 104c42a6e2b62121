"""Dataset preparation: load, validate, tokenize, truncate and save every split as Arrow."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import datasets
from prefect import get_run_logger, task

from infra.core.config import DataConfig, DatasetSource, ExperimentConfig, is_template_text, template_file
from infra.core.fingerprints import atomic_directory, code_fingerprint, hash_paths, hash_token_ids, hash_value
from infra.core.handles import ModelHandle, PreparedData
from infra.core.settings import get_settings
from trainers.catalog import STAGES
from trainers.data.clipping import TextClip
from trainers.data.lengths import AUTO, context_length, prompt_lengths, resolve_truncation
from trainers.data.rows import (
    MARGIN,
    SPLIT_FIELDS,
    DataValidationError,
    RenderedRow,
    Truncation,
    load_rows,
    mixing_rng,
    normalize_rows,
    render_rows,
    select_rows,
    truncate_rows,
    validate_rows,
)
from trainers.data.synthetic import AdditionTask, generate_addition
from trainers.generation.budget import evaluation_generation

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
    if not is_template_text(value):
        try:
            return template_file(value).read_text(encoding="utf-8")
        except ValueError as error:  # checked at load time too; the file may have moved since
            raise ValueError(f"data.chat_template: {error}") from None
    return value


def data_fingerprint(config: DataConfig, tokenizer: ModelHandle) -> str:
    sources = {split: [source_identity(s) for s in source_list(getattr(config, split))] for split in SPLIT_FIELDS}
    automatic = AUTO in (config.max_length, config.max_prompt_length)
    return hash_value(
        {
            # this module and the trainers code it runs: loading, validating, tokenizing, the built-in task
            "code": code_fingerprint(__name__),
            "builtin": config.builtin.model_dump() if config.builtin else None,
            "sources": {split: identities for split, identities in sources.items() if identities},
            "truncation": [config.max_length, config.max_prompt_length, config.truncation_mode],
            # automatic lengths are capped by the model's context, which the tokenizer does not name
            **({"context": context_length(tokenizer.path, tokenizer.revision)} if automatic else {}),
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


RenderedSource = tuple[str, list[RenderedRow], DatasetSource | None]


def render_splits(config: DataConfig, tokenizer, context: int | None) -> dict[str, list[RenderedSource]]:
    """Every source of every split normalized, validated and rendered to token ids, uncut, each text
    clipped first to what the lengths (or the model's ``context``) could keep (:mod:`trainers.data.clipping`)."""
    most = config.max_length if config.max_length != AUTO else context
    keep_end = config.truncation_mode == "keep_end"
    clip = TextClip.for_tokenizer(tokenizer, most, keep_end) if most else None
    rendered: dict[str, list[RenderedSource]] = {}
    for split, parts in raw_splits(config).items():
        rendered[split] = []
        for name, raw, source in parts:
            normalized = normalize_rows(raw, split, name)
            validate_rows(normalized, SPLIT_FIELDS[split], name)
            rendered[split].append((name, render_rows(normalized, split, tokenizer, name, clip), source))
    return rendered


def prepare_split(
    parts: list[RenderedSource], split: str, truncation: Truncation, seed: int
) -> tuple[list[dict], dict]:
    """Truncate each source of a split, then take each source's share (``weight`` / ``num_samples``,
    seeded) of its kept rows, in source order. Returns the rows and the split's report: rows read,
    dropped, cut (counted on the rows read) and per source counts."""
    rows = []
    report = {"rows_read": 0, "dropped": 0, "cut": 0, "truncated_prompts": 0, "truncated_completions": 0}
    report |= {"unterminated": 0, "identical": 0}
    sources: list[dict[str, str | int]] = []
    for index, (name, rendered, source) in enumerate(parts):
        result = truncate_rows(rendered, truncation)
        if not result.rows:
            raise DataValidationError(
                f"{name}: every row of split {split!r} was dropped by truncation "
                f"(max_length={truncation.max_length}, max_prompt_length={truncation.max_prompt_length}, "
                f"mode={truncation.mode})"
            )
        weight, num_samples = (source.weight, source.num_samples) if source else (None, None)
        used = select_rows(result.rows, weight, num_samples, mixing_rng(seed, split, index))
        rows += used
        report["rows_read"] += len(rendered)
        report["dropped"] += result.dropped
        report["cut"] += result.cut
        report["truncated_prompts"] += result.truncated_prompts
        report["truncated_completions"] += result.truncated_completions
        report["unterminated"] += result.unterminated
        report["identical"] += result.identical
        sources.append(
            {
                "source": name,
                "rows_read": len(rendered),
                "dropped": result.dropped,
                "truncated_prompts": result.truncated_prompts,
                "rows_used": len(used),
            }
        )
    if not rows:
        raise ValueError(f"split {split!r}: the sources' weight / num_samples select no rows")
    with_margin = sum(MARGIN in row for row in rows)
    if 0 < with_margin < len(rows):
        names = ", ".join(name for name, _, _ in parts)
        raise DataValidationError(
            f"split {split!r} ({names}): {with_margin} of {len(rows)} pairs have a '{MARGIN}': give every pair one, "
            "or none"
        )
    return rows, report | {"sources": sources}


def check_context(config: DataConfig, context: int | None, model: ModelHandle) -> None:
    """Refuse a fixed ``data.max_length`` beyond the model's context: rows that long would reach
    positions the model was never built for (learned position embeddings fail with an index error,
    rotary ones degrade silently). ``auto`` is capped by the context instead."""
    if context is None or config.max_length == AUTO or config.max_length <= context:
        return
    raise DataValidationError(
        f"data.max_length={config.max_length} is longer than the model's context: {model.path} takes at most "
        f"{context} positions (its config.json). Set data.max_length to at most {context}, or to auto"
    )


def check_generations(config: ExperimentConfig, data: PreparedData) -> None:
    """Refuse, before any stage trains, a generation that would not fit the model's context (as
    preparation read it, :attr:`PreparedData.context`; None: unknown, where an engine's own length
    may still apply): each stage's that samples while it trains
    (:attr:`trainers.stages.spec.StageSpec.generation`) on the prepared prompts of the split it
    trains on, and the evaluation's on the held-out prompts it scores. Its trainer or the evaluation
    would refuse it too, but only once the stages before it had trained. Raises ValueError naming
    the settings."""
    context, prepared = data.context, datasets.load_from_disk(data.path)
    for stage in config.stages:
        spec = STAGES[stage]
        generation = spec.generation(config.stage(stage))
        split = next((s for s in spec.splits if s in prepared), None)
        if generation is not None and split is not None:
            generation.check(prompt_lengths(prepared[split]), context)
    if "eval_prompts" in prepared:
        held_out = prepared["eval_prompts"]
        scored = held_out.select(range(min(config.evaluation.num_prompts, len(held_out))))
        evaluation_generation(config.evaluation.max_new_tokens).check(prompt_lengths(scored), context)


def check_cut_share(manifest: dict, config: DataConfig) -> None:
    """Refuse data whose truncation cut or dropped more than ``data.max_cut_share`` of a split's
    rows, with the counts, the lengths that would fit, and both ways out."""
    over = {
        split: (cut, manifest["rows_read"][split])
        for split, cut in manifest["cut"].items()
        if cut > config.max_cut_share * manifest["rows_read"][split]
    }
    if not over:
        return
    used, fitted = manifest["truncation"], manifest["fitted_lengths"]
    counts = "; ".join(
        f"{split}: {cut} of {read} rows ({manifest['truncated_prompts'][split]} prompts cut, "
        f"{manifest['truncated_completions'][split]} completions cut, {manifest['dropped'][split]} dropped)"
        for split, (cut, read) in over.items()
    )
    raise DataValidationError(
        f"data: truncation at max_length={used['max_length']}, max_prompt_length={used['max_prompt_length']} "
        f"cuts more than data.max_cut_share={config.max_cut_share} of the rows: {counts}. Set "
        f"data.max_length=auto data.max_prompt_length=auto (here {fitted['max_length']} and "
        f"{fitted['max_prompt_length']}: they fit 99.5% of every split), or set data.max_cut_share=1 to train "
        "on the cut rows"
    )


def tokenize_splits(config: DataConfig, handle: ModelHandle) -> tuple[dict[str, list[dict]], dict]:
    """The prepared rows of every split and the manifest that describes them."""
    from trainers.models.pretrained import load_tokenizer  # transformers: only when preparing

    tokenizer = load_tokenizer(handle.path, handle.revision)
    template = resolve_chat_template(config.chat_template)
    if template is not None:
        tokenizer.chat_template = template
    context = context_length(handle.path, handle.revision)
    check_context(config, context, handle)
    rendered = render_splits(config, tokenizer, context)
    flat = {split: [row for _, rows, _ in parts for row in rows] for split, parts in rendered.items()}
    mode = config.truncation_mode
    truncation = resolve_truncation(flat, config.max_length, config.max_prompt_length, mode, context)
    fitted = resolve_truncation(flat, AUTO, AUTO, mode, context)
    tokenized, reports = {}, {}
    for split, parts in rendered.items():
        tokenized[split], reports[split] = prepare_split(parts, split, truncation, config.seed)
    counts = ("rows_read", "dropped", "cut", "truncated_prompts", "truncated_completions")
    manifest = {
        "rows": {s: len(r) for s, r in tokenized.items()},
        **{count: {s: r[count] for s, r in reports.items()} for count in counts},
        "unterminated_completions": {s: r["unterminated"] for s, r in reports.items() if r["unterminated"]},
        "identical_pairs": {s: r["identical"] for s, r in reports.items() if r["identical"]},
        "sources": {s: r["sources"] for s, r in reports.items()},
        "truncation": asdict(truncation),
        "fitted_lengths": {"max_length": fitted.max_length, "max_prompt_length": fitted.max_prompt_length},
        "context": context,
        "chat_template": template,
    }
    return tokenized, manifest


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
        tokenized, manifest = tokenize_splits(config, tokenizer)
        splits = datasets.DatasetDict({s: datasets.Dataset.from_list(r) for s, r in tokenized.items()})
        with atomic_directory(target) as staging:
            splits.save_to_disk(staging / "data")
            manifest["token_fingerprints"] = {s: hash_token_ids(d) for s, d in splits.items()}
            (staging / MANIFEST).write_text(json.dumps(manifest, indent=2))
    manifest = json.loads((target / MANIFEST).read_text())
    report_lengths(manifest, config)
    check_cut_share(manifest, config)  # on a cached preparation too: the share is not part of the key
    return PreparedData(
        path=str(target / "data"),
        fingerprint=fingerprint,
        rows=manifest["rows"],
        dropped=manifest["dropped"],
        truncated_prompts=manifest["truncated_prompts"],
        truncated_completions=manifest["truncated_completions"],
        token_fingerprints=manifest["token_fingerprints"],
        truncation=manifest["truncation"],
        context=manifest["context"],
        chat_template=manifest["chat_template"],
    )


def report_lengths(manifest: dict, config: DataConfig) -> None:
    """Log the lengths used, what truncation did to each split, and the rows left out or suspect."""
    logger = get_run_logger()
    used, fitted = manifest["truncation"], manifest["fitted_lengths"]
    chosen = "auto" if AUTO in (config.max_length, config.max_prompt_length) else "fixed"
    logger.info(
        "lengths (%s): max_length=%d, max_prompt_length=%d; fitting 99.5%% of every split: %d and %d "
        "(model context: %s)",
        chosen,
        used["max_length"],
        used["max_prompt_length"],
        fitted["max_length"],
        fitted["max_prompt_length"],
        manifest["context"] or "unknown",
    )
    if any(manifest["cut"].values()):
        logger.warning(
            "rows cut or dropped by truncation (%s): %s of %s (prompts cut: %s, completions cut: %s, dropped: %s)",
            config.truncation_mode,
            manifest["cut"],
            manifest["rows_read"],
            manifest["truncated_prompts"],
            manifest["truncated_completions"],
            manifest["dropped"],
        )
    if manifest["identical_pairs"]:
        logger.warning(
            "preference pairs left out because chosen and rejected are the same (they teach nothing): %s",
            manifest["identical_pairs"],
        )
    if manifest["unterminated_completions"]:
        logger.warning(
            "rows whose completion does not end with EOS or a special end-of-turn token: %s of %s. A model "
            "trained on them does not learn where to stop, and generation cannot stop at a plain-text marker: "
            "make the chat template's end-of-turn marker a special token of the tokenizer, or end each turn with "
            "its EOS (docs/data-and-models.md, where generation stops)",
            manifest["unterminated_completions"],
            manifest["rows"],
        )
