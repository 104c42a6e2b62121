"""Validation and tokenization of prompt/completion, preference and evaluation data.

Rows are either *standard* (strings) or *conversational* (lists of ``{"role", "content"}``
messages). Conversational prompts are rendered with the tokenizer's chat template and the
generation prompt; a completion is the assistant text followed by EOS.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Literal

import datasets
from transformers import PreTrainedTokenizerBase

SPLIT_FIELDS: dict[str, tuple[str, ...]] = {
    "sft": ("prompt", "completion"),
    "preference": ("prompt", "chosen", "rejected"),
    "preference_eval": ("prompt", "chosen", "rejected"),
    "eval_prompts": ("prompt", "answer"),
    "grpo_prompts": ("prompt",),  # an `answer` column, when present, reaches the reward functions
}
COMPLETION_FIELDS = {"completion", "chosen", "rejected"}
LOCAL_BUILDERS = {".parquet": "parquet", ".csv": "csv"}
JSON_SUFFIXES = {".json", ".jsonl"}


class DataValidationError(ValueError):
    """A row of an input dataset is unusable; the message names the source, row and field."""


@dataclass(frozen=True)
class Truncation:
    """``max_prompt_length`` cuts the prompt (``keep_end``: keep its last tokens, ``keep_start``:
    its first); the completion is then cut to fit ``max_length``, keeping its start."""

    max_length: int
    max_prompt_length: int
    mode: Literal["keep_end", "keep_start"] = "keep_end"


def load_rows(path: str, name: str | None = None, split: str = "train", revision: str | None = None) -> list[dict]:
    """Rows of a local json/jsonl/parquet/csv file or of any ``datasets.load_dataset`` source."""
    suffix = Path(path).suffix.lower()
    if (suffix in JSON_SUFFIXES or suffix in LOCAL_BUILDERS) and not Path(path).is_file():
        raise FileNotFoundError(f"dataset file not found: {path}")
    if suffix in JSON_SUFFIXES:
        # Read JSON ourselves: Arrow would coerce mixed types per column and hide bad rows.
        return read_json_rows(Path(path))
    if suffix in LOCAL_BUILDERS:
        dataset = datasets.load_dataset(LOCAL_BUILDERS[suffix], data_files=str(path), split="train")
    else:
        dataset = datasets.load_dataset(path, name, split=split, revision=revision)
    return dataset.to_list()


def read_json_rows(path: Path) -> list[dict]:
    """A ``.jsonl`` file (one object per line) or a ``.json`` file holding a list of objects."""
    if path.suffix.lower() == ".json":
        rows = json.loads(path.read_text())
    else:
        rows = []
        for number, line in enumerate(path.read_text().splitlines()):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise DataValidationError(f"{path}: line {number + 1}: invalid JSON ({error.msg})") from None
    if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        raise DataValidationError(f"{path}: expected JSON objects, one per row")
    return rows


def _is_conversation(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
        )
    )


def validate_rows(rows: Iterable[dict], fields: tuple[str, ...], source: str) -> None:
    """Raise :class:`DataValidationError` at the first missing, empty or mistyped field."""
    for index, row in enumerate(rows):
        for field in fields:
            where = f"{source}: row {index}: field '{field}'"
            value = row.get(field)
            if value is None:
                raise DataValidationError(f"{where} is missing")
            if isinstance(value, str):
                if field in COMPLETION_FIELDS and not value.strip():
                    raise DataValidationError(f"{where} is an empty completion")
            elif not _is_conversation(value):
                raise DataValidationError(
                    f"{where} must be a string or a list of {{role, content}} messages, got {type(value).__name__}"
                )


def render_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str | list[dict]) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer(prompt).input_ids
    text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


def render_completion(tokenizer: PreTrainedTokenizerBase, completion: str | list[dict]) -> list[int]:
    text = completion if isinstance(completion, str) else "".join(m["content"] for m in completion)
    return tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]


def truncate_prompt(prompt_ids: list[int], truncation: Truncation) -> list[int]:
    limit = truncation.max_prompt_length
    if len(prompt_ids) <= limit:
        return prompt_ids
    return prompt_ids[-limit:] if truncation.mode == "keep_end" else prompt_ids[:limit]


def tokenize_split(
    rows: list[dict], split: str, tokenizer: PreTrainedTokenizerBase, truncation: Truncation
) -> tuple[list[dict], int]:
    """Tokenize one split; returns the rows kept and how many were dropped because truncation
    left a completion with no tokens."""
    completion_fields = [f for f in SPLIT_FIELDS[split] if f in COMPLETION_FIELDS]
    kept, dropped = [], 0
    for row in rows:
        prompt_ids = truncate_prompt(render_prompt(tokenizer, row["prompt"]), truncation)
        budget = truncation.max_length - len(prompt_ids)
        out = {"prompt_ids": prompt_ids}
        for field in completion_fields:
            out[f"{field}_ids"] = render_completion(tokenizer, row[field])[: max(budget, 0)]
        if any(len(out[f"{field}_ids"]) == 0 for field in completion_fields):
            dropped += 1
            continue
        if "answer" in row:
            out["answer"] = str(row["answer"])
        kept.append(out)
    return kept, dropped
