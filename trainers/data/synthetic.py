"""Built-in verifiable task: integer addition, written as ``"a+b="`` → ``"c"``.

One generator yields every split the pipeline needs, from disjoint problem sets:
noisy SFT demonstrations, preference pairs (correct vs. plausible wrong answer), GRPO prompts
with their ground truth (the training problems) and held-out prompts with their ground truth.
Deterministic for a seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# Errors people (and small models) make: off by one or two, or a dropped / doubled carry.
PLAUSIBLE_ERRORS = (-10, -2, -1, 1, 2, 10)


@dataclass(frozen=True)
class AdditionTask:
    max_operand: int = 49
    noise: float = 0.3
    num_eval_problems: int = 300
    seed: int = 0


def prompt_for(a: int, b: int) -> str:
    return f"{a}+{b}="


def wrong_answer(correct: int, rng: random.Random) -> int:
    candidates = [correct + e for e in PLAUSIBLE_ERRORS if correct + e >= 0]
    return rng.choice(candidates)


def generate_addition(task: AdditionTask) -> dict[str, list[dict]]:
    """Return ``sft``, ``preference``, ``preference_eval``, ``grpo_prompts`` and ``eval_prompts`` rows."""
    rng = random.Random(task.seed)
    problems = [(a, b) for a in range(task.max_operand + 1) for b in range(task.max_operand + 1)]
    rng.shuffle(problems)
    if task.num_eval_problems >= len(problems):
        raise ValueError(f"num_eval_problems={task.num_eval_problems} leaves no training problems")
    eval_problems, train_problems = problems[: task.num_eval_problems], problems[task.num_eval_problems :]

    def demonstration(a: int, b: int) -> dict:
        answer = a + b if rng.random() >= task.noise else wrong_answer(a + b, rng)
        return {"prompt": prompt_for(a, b), "completion": str(answer)}

    def pair(a: int, b: int) -> dict:
        return {"prompt": prompt_for(a, b), "chosen": str(a + b), "rejected": str(wrong_answer(a + b, rng))}

    def verifiable(problems: list[tuple[int, int]]) -> list[dict]:
        return [{"prompt": prompt_for(a, b), "answer": str(a + b)} for a, b in problems]

    return {
        "sft": [demonstration(a, b) for a, b in train_problems],
        "preference": [pair(a, b) for a, b in train_problems],
        "preference_eval": [pair(a, b) for a, b in eval_problems],
        "grpo_prompts": verifiable(train_problems),
        "eval_prompts": verifiable(eval_problems),
    }
