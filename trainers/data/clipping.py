"""Long texts clipped in characters before they are tokenized, so that preparing data takes memory
in proportion to the lengths kept, not to the longest row.

A fast tokenizer holds about two hundred bytes per character of a text it encodes (ids, offsets,
word boundaries): one 50 MB prompt took 10 GB. No token covers more characters than the longest
string in the vocabulary (``longest``), so a text of more than ``(n + margin) · longest``
characters has more than ``n + margin`` tokens. When at most ``n`` of its tokens can be kept (the
configured ``max_length``, or the model's context), the characters beyond that are dropped before
tokenizing, on the side truncation cuts: a prompt's start under ``keep_end``, else its end; a
completion's end. The ``margin`` tokens next to the clip, which may tokenize differently there,
are then cut by truncation as well, and the row still counts as cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MARGIN_TOKENS = 64


@dataclass(frozen=True)
class TextClip:
    max_chars: int
    keep_end: bool  # prompts keep their end (keep_end truncation); completions always keep their start

    @classmethod
    def for_tokenizer(cls, tokenizer: PreTrainedTokenizerBase, max_tokens: int, keep_end: bool) -> TextClip:
        longest = max(map(len, tokenizer.get_vocab()), default=1)
        return cls((max_tokens + MARGIN_TOKENS) * longest, keep_end)

    def prompt(self, text: str) -> str:
        if len(text) <= self.max_chars:
            return text
        return text[-self.max_chars :] if self.keep_end else text[: self.max_chars]

    def completion(self, text: str) -> str:
        return text[: self.max_chars]
