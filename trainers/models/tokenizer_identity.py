"""A tokenizer's identity by what it does, not by the bytes of its files.

``save_pretrained`` rewrites a tokenizer's files without changing what it does: it adds
``is_local`` and ``local_files_only`` to ``tokenizer_config.json``, renames ``tokenizer_class``,
writes merges in the newer list form and fills in defaults. A fingerprint of the bytes then tells a
fine-tuned model from its own base model, and nothing could compare them. :func:`tokenizer_identity`
is what tokenization depends on, canonicalised: the model's vocabulary and merges, the added
tokens, the ids and decoded text of a fixed set of probe strings (which is what the normalizer,
pre-tokenizer, post-processor and decoder do, however their JSON is written), the special tokens,
the chat template and the padding side.

It reads the tokenizer as ``AutoTokenizer`` loads it, not ``tokenizer.json`` alone: transformers
may replace parts of the file's pipeline (a folder whose ``config.json`` names a Qwen2 model loads
as ``Qwen2Tokenizer``, with its own pre-tokenizer and NFC normalizer), and what training and
evaluation see is the loaded tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TOKENIZER_JSON = "tokenizer.json"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
# Text that exercises normalisation (composed and decomposed accents, full-width forms), pre-tokenizing
# (spaces, tabs, newlines, digits, punctuation, code), byte fallback (CJK, emoji) and casing.
PROBES = (
    "The quick brown fox jumps over the lazy dog.",
    "  leading and  double spaces, trailing ",
    "tabs\tand\nnew\n\nlines\r\n",
    "12345 + 678 = 7023; pi ≈ 3.14159",
    "def f(x):\n    return x ** 2  # square",
    "café naïve façade, cafe\u0301 nai\u0308ve",
    "ＡＢＣ full-width, ﬁ ligature, Ω ohm",
    "你好，世界。こんにちは 안녕하세요",
    "emoji 👍🏽 and 🤖!",
    "MiXeD CaSe, UPPER, lower",
)


def tokenizer_identity(folder: Path) -> dict[str, Any]:
    """What tokenization by the tokenizer saved in ``folder``, as transformers loads it, depends on
    (see the module's docstring); the folder must hold ``tokenizer.json``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    backend = tokenizer.backend_tokenizer
    model = json.loads(backend.to_str())["model"]
    added = backend.get_added_tokens_decoder()
    probes = [*PROBES, *(f"a{token.content} b" for token in added.values())]
    encoded = [backend.encode(text, add_special_tokens=flag).ids for text in probes for flag in (False, True)]
    return {
        "model": {key: model.get(key) for key in ("type", "vocab", "merges")},
        "added_tokens": [[index, token.content, token.special] for index, token in sorted(added.items())],
        "probes": encoded,
        "decoded": [backend.decode(ids, skip_special_tokens=False) for ids in encoded],
        "special_tokens": {name: getattr(tokenizer, name, None) for name in SPECIAL_TOKENS},
        "chat_template": tokenizer.chat_template,
        "padding_side": tokenizer.padding_side,
        "add_bos_eos": [getattr(tokenizer, "add_bos_token", None), getattr(tokenizer, "add_eos_token", None)],
    }
