"""Loading causal LMs and their tokenizers from any checkpoint (local path or hub id)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from trainers.devices import torch_dtype
from trainers.lora import ADAPTER_CONFIG


def load_tokenizer(path: str, revision: str | None = None) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(path, revision=revision)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(
    path: str, revision: str | None = None, dtype: str = "auto", device: torch.device | str | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model in ``dtype`` (``auto``: the checkpoint's own; see ``compute.dtype``), on ``device``
    (None: where transformers puts it, the CPU; a Trainer moves it to its own device), and its tokenizer."""
    tokenizer = load_tokenizer(path, revision)
    model = AutoModelForCausalLM.from_pretrained(path, revision=revision, dtype=torch_dtype(dtype))
    if device is not None:
        model.to(device)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def load_dtype(path: str, revision: str | None = None, dtype: str = "auto") -> str:
    """The dtype :func:`load_causal_lm` loads ``path`` in, without loading its weights: ``dtype``,
    or for ``auto`` the one the checkpoint's config declares (``float32`` when it declares none; an
    adapter folder's base model's)."""
    if dtype != "auto":
        return dtype
    adapter = Path(path) / ADAPTER_CONFIG
    if adapter.is_file():  # a LoRA adapter folder loads on its base model, in the base's dtype
        return load_dtype(json.loads(adapter.read_text())["base_model_name_or_path"], None, dtype)
    declared = AutoConfig.from_pretrained(path, revision=revision).dtype
    return str(declared or torch.float32).removeprefix("torch.")
