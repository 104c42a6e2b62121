"""Chat-shaped synthetic rows: prompts and completions whose token lengths follow the long tail of
chat preference data, for benchmarks and for running the stages at real shapes without a download.

Lengths are log-normal, clipped: prompts with a median of 96 tokens, completions with a median of
256, every row within 2,048 tokens (quantiles in docs/padding-free.md). The shape is chosen to
resemble chat preference and SFT data such as UltraFeedback and the Tulu 3 mixtures (short prompts,
answers of a few hundred tokens, a tail past a thousand); it is not fitted to either, as no dataset
is downloaded here. The texts are random characters of the built-in tokenizer's alphabet, so with a
built-in model one character is one token.

    python -m trainers.data.chat_shapes OUT_DIR [--rows 512] [--seed 0]   # writes sft/preference/grpo_prompts .jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import random
import string
from dataclasses import dataclass
from pathlib import Path

ALPHABET = string.ascii_lowercase + "      "  # words of about five letters


@dataclass(frozen=True)
class LengthDistribution:
    """A log-normal length, clipped to ``[low, high]``: ``exp(N(log median, sigma²))``."""

    median: float
    sigma: float
    low: int
    high: int

    def draw(self, rng: random.Random) -> int:
        return min(self.high, max(self.low, round(math.exp(rng.gauss(math.log(self.median), self.sigma)))))

    def quantile(self, q: float) -> float:
        """The unclipped distribution's ``q`` quantile (for the documentation's figures)."""
        return self.median * math.exp(self.sigma * _normal_quantile(q))


def _normal_quantile(q: float) -> float:
    """Φ⁻¹(q) by bisection (no scipy)."""
    low, high = -10.0, 10.0
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (middle, high) if 0.5 * math.erfc(-middle / math.sqrt(2)) < q else (low, middle)
    return (low + high) / 2


@dataclass(frozen=True)
class ChatShape:
    prompt: LengthDistribution = LengthDistribution(median=96, sigma=1.0, low=4, high=1536)
    completion: LengthDistribution = LengthDistribution(median=256, sigma=0.8, low=4, high=2048)
    max_length: int = 2048  # prompt + completion

    def lengths(self, rng: random.Random) -> tuple[int, int]:
        """A prompt length and a completion length, together within ``max_length``."""
        prompt = self.prompt.draw(rng)
        return prompt, min(self.completion.draw(rng), self.max_length - prompt)


def random_text(length: int, rng: random.Random) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(length))


def generate_chat_shaped(rows: int, seed: int = 0, shape: ChatShape = ChatShape()) -> dict[str, list[dict]]:
    """``sft`` (prompt/completion), ``preference`` (prompt/chosen/rejected: two independent completion
    lengths) and ``grpo_prompts`` (prompt/answer) rows of ``shape``, deterministic for ``seed``."""
    rng = random.Random(seed)
    sft, preference, prompts = [], [], []
    for _ in range(rows):
        prompt_length, completion_length = shape.lengths(rng)
        prompt = random_text(prompt_length, rng)
        sft.append({"prompt": prompt, "completion": random_text(completion_length, rng)})
        other = min(shape.completion.draw(rng), shape.max_length - prompt_length)
        preference.append(
            {"prompt": prompt, "chosen": random_text(completion_length, rng), "rejected": random_text(other, rng)}
        )
        prompts.append({"prompt": prompt, "answer": random_text(4, rng)})
    return {"sft": sft, "preference": preference, "grpo_prompts": prompts}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args(argv)
    options.out.mkdir(parents=True, exist_ok=True)
    for split, rows in generate_chat_shaped(options.rows, options.seed).items():
        path = options.out / f"{split}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        print(f"{path}: {len(rows)} rows")


if __name__ == "__main__":
    main()
