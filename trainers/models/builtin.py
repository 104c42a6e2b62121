"""The built-in tiny model: a small ``LlamaForCausalLM`` and a character-level tokenizer.

Both are built locally (no downloads) and saved with ``save_pretrained`` so that every later
stage loads them exactly like any Hugging Face checkpoint. torch, tokenizers and transformers
are imported by the functions that build: a run that finds the model saved already reads only
:func:`builtin_spec`.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

BUILTIN_PREFIX = "builtin:"
SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
CHARACTERS = string.digits + string.ascii_letters + string.punctuation + " \n"

# Roles are special tokens, so a rendered conversation is unambiguous at the character level.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}</s>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

TINY_LLAMA = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=128,
    tie_word_embeddings=True,
)
# Qwen2.5-0.5B's shape as a Llama (no q/k/v biases): 24 layers, hidden 896, 14 query and 2 KV heads,
# MLP 4,864, tied embeddings, and its padded vocabulary of 151,936 rows (the tokenizer uses the first
# few; the rest decode to nothing), which sizes the logits as in the real model: 494M parameters.
LLAMA_0_5B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rope_theta=1_000_000.0,
    tie_word_embeddings=True,
    vocab_size=151_936,
)
# The 20M-parameter shape on which generation dominates a GRPO step (vLLM against `generate`:
# benchmarks/grpo.py): hidden 384, 8 layers, a padded vocabulary of 16,384 rows.
LLAMA_20M = dict(
    hidden_size=384,
    intermediate_size=1024,
    num_hidden_layers=8,
    num_attention_heads=6,
    num_key_value_heads=6,
    max_position_embeddings=256,
    tie_word_embeddings=True,
    vocab_size=16_384,
)
BUILTIN_MODELS = {"tiny-llama": TINY_LLAMA, "llama-20m": LLAMA_20M, "llama-0.5b": LLAMA_0_5B}


def is_builtin(source: str) -> bool:
    return source.startswith(BUILTIN_PREFIX)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer: BPE with a character vocabulary and no merges."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab_tokens = list(SPECIAL_TOKENS.values()) + ROLE_TOKENS + list(CHARACTERS)
    vocab = {token: index for index, token in enumerate(vocab_tokens)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=SPECIAL_TOKENS["unk_token"]))
    backend.add_special_tokens(list(SPECIAL_TOKENS.values()) + ROLE_TOKENS)
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **SPECIAL_TOKENS)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def builtin_spec(source: str, seed: int) -> dict:
    """What determines a built-in model besides this module's source (which holds its tokenizer):
    the name, the architecture and the initialisation seed."""
    name = source.removeprefix(BUILTIN_PREFIX)
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown built-in model {source!r}; known: {sorted(BUILTIN_MODELS)}")
    return {
        "name": name,
        "architecture": BUILTIN_MODELS[name],
        "seed": seed,
    }


def build_builtin_model(source: str, seed: int) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """Build the named built-in model with freshly initialised weights (deterministic for ``seed``)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    architecture = builtin_spec(source, seed)["architecture"]
    tokenizer = build_char_tokenizer()
    config = LlamaConfig(
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **{"vocab_size": len(tokenizer), **architecture},  # an architecture may pad the vocabulary
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def save_builtin_model(source: str, seed: int, output_dir: Path) -> Path:
    model, tokenizer = build_builtin_model(source, seed)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return output_dir
