"""Loading causal LMs and their tokenizers from any checkpoint (local path or hub id)."""

from __future__ import annotations

from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase


def load_tokenizer(path: str, revision: str | None = None) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(path, revision=revision)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(path: str, revision: str | None = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    tokenizer = load_tokenizer(path, revision)
    model = AutoModelForCausalLM.from_pretrained(path, revision=revision)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer
