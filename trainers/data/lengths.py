"""Token lengths from the data: ``max_length`` / ``max_prompt_length: auto``.

A fixed length suits one dataset: the built-in task's 32/16 cuts every ChatML prompt (a system
turn alone is longer). ``auto`` reads the lengths off the rendered rows instead: the prompt limit
is the smallest length that fits :data:`FIT_SHARE` of every split's prompts, the total limit the
smallest that fits that share of every split's (prompt as cut + longest completion), each rounded
up to a multiple of :data:`ROUND_TO`, and both capped by the model's context. Each cap cuts at most
0.5% of a split's rows, so the two together at most 1%.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Final, Literal

import datasets
import pyarrow.compute

from trainers.data.rows import RenderedRow, Truncation

AUTO: Final = "auto"
FIT_SHARE = 0.995
ROUND_TO = 8

Length = int | Literal["auto"]


def fitting_length(lengths: Sequence[int], share: float = FIT_SHARE) -> int:
    """The smallest multiple of :data:`ROUND_TO` that is at least ``share`` of ``lengths`` (one
    nearest-rank quantile: no interpolation, so the result is a length some row has, rounded up)."""
    if not lengths:
        return 0
    rank = max(math.ceil(share * len(lengths)), 1)
    return math.ceil(sorted(lengths)[rank - 1] / ROUND_TO) * ROUND_TO


def resolve_truncation(
    splits: Mapping[str, Iterable[RenderedRow]],
    max_length: Length,
    max_prompt_length: Length,
    mode: Literal["keep_end", "keep_start", "drop"],
    context: int | None,
) -> Truncation:
    """The lengths to cut ``splits`` to: fixed values as given, ``auto`` ones from the rows (see
    the module), capped by ``context`` (the model's maximum positions, None: unknown). A fixed
    ``max_length`` caps an automatic prompt length at ``max_length - 1``; an automatic total is at
    least the prompt length + 1, so every completion keeps a token."""
    rows = {split: list(rendered) for split, rendered in splits.items()}
    ceiling = max_length if max_length != AUTO else context
    if max_prompt_length == AUTO:
        prompt = max((fitting_length([len(r.prompt_ids) for r in split]) for split in rows.values()), default=1)
        prompt = max(min(prompt, ceiling - 1) if ceiling else prompt, 1)
    else:
        prompt = max_prompt_length
    if max_length == AUTO:
        total = max(
            (
                fitting_length([min(len(r.prompt_ids), prompt) + r.longest for r in split if r.completions])
                for split in rows.values()
            ),
            default=0,
        )
        total = max(min(total, context) if context else total, prompt + 1)
    else:
        total = max_length
    return Truncation(total, prompt, mode)


# Where model configs state how many positions the model takes (Llama/Qwen/Gemma, GPT-2, others).
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")
# Rotary scalings whose config states the scaled length itself (vLLM's exceptions alike).
UNSCALED_ROPE_TYPES = (None, "default", "llama3", "longrope", "su")


def context_length(path: str, revision: str | None = None) -> int | None:
    """The model's maximum positions as its ``config.json`` states them, or None where there is no
    config (a tokenizer alone, a hub id that cannot be reached) or it names none. Read as JSON (a
    hub model's from the Hugging Face cache, downloaded once): no transformers, no torch, so a run
    that finds its data prepared stays light."""
    file = Path(path) / "config.json"
    if not file.is_file():
        if Path(path).exists() or Path(path).is_absolute():
            return None
        from huggingface_hub import hf_hub_download, try_to_load_from_cache
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

        cached = try_to_load_from_cache(path, "config.json", revision=revision)
        try:
            file = Path(cached if isinstance(cached, str) else hf_hub_download(path, "config.json", revision=revision))
        except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError):
            return None
    return config_context(json.loads(file.read_text()))


def config_context(config: Mapping) -> int | None:
    """The maximum positions a model config (``config.json`` as a mapping) names, or None; for a
    rotary embedding scaled by ``factor`` (YaRN, linear, dynamic NTK), the scaled length, as vLLM
    derives it: a YaRN config states its unscaled length (Qwen2.5: 32768, factor 4), and Llama 3.1's
    ``llama3`` and Phi-3's ``longrope`` state the scaled one already."""
    positions = next((config[key] for key in CONTEXT_KEYS if isinstance(config.get(key), int)), None)
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}  # transformers 5 names it rope_parameters
    kind, factor = rope.get("rope_type", rope.get("type")), rope.get("factor")
    if positions is None or kind in UNSCALED_ROPE_TYPES or not isinstance(factor, int | float) or factor <= 1:
        return positions
    base = rope.get("original_max_position_embeddings", positions) if kind == "yarn" else positions
    return int(base * factor)


def model_context(model) -> int | None:
    """The maximum positions of a loaded model, as its config names them (:func:`config_context`)."""
    return config_context(model.config.to_dict())


def prompt_lengths(dataset) -> list[int]:
    """The token count of each prompt (``prompt_ids``) of ``dataset``: Arrow's list lengths for a
    ``datasets.Dataset`` (no row is decoded), none without a dataset."""
    if dataset is None:
        return []
    if isinstance(dataset, datasets.Dataset):
        return pyarrow.compute.list_value_length(dataset.data.column("prompt_ids")).to_pylist()
    return [len(row["prompt_ids"]) for row in dataset]
