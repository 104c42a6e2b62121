"""Evaluation statistics: exact-match answers, unbiased pass@k and seeded bootstrap confidence intervals."""

from __future__ import annotations

from dataclasses import dataclass
from math import comb

import numpy as np

PREFERENCE_METRICS = ("rewards/accuracies", "rewards/margins", "logratios/margins")
ANSWER_METRICS = ("greedy_accuracy", "sampled_accuracy")
# The mean score of a model's sampled completions by the evaluation's reward model (``evaluation.reward_model``).
REWARD_MODEL_METRIC = "reward_model_score"


@dataclass(frozen=True)
class ModelScores:
    """One model's evaluation (``trainers.evaluation.evaluate.evaluate_model``): what the table and MLflow show."""

    metrics: dict[str, float]
    samples: dict[str, list]  # the samples table: prompt, answer, completion, reward, correct
    per_prompt: dict[str, list[float]]  # metric -> one value per held-out prompt


def per_prompt_metric_names(pass_ks: list[int], num_samples: int, reward_model: bool = False) -> list[str]:
    """The metrics with one value per held-out prompt (what a paired comparison resamples); with
    ``reward_model`` (an ``evaluation.reward_model``) also its mean score of each prompt's samples."""
    scored = (REWARD_MODEL_METRIC,) if reward_model else ()
    return [*ANSWER_METRICS, *(f"pass_at_{k}" for k in dict.fromkeys(pass_ks) if k <= num_samples), *scored]


def evaluation_metric_names(pass_ks: list[int], num_samples: int, reward_model: bool = False) -> list[str]:
    """Every metric the evaluation can report for a model (``trainers.evaluation.evaluate``): the answer
    metrics with their CIs, pass@k for k ≤ N, the reward model's score with its CI (with
    ``reward_model``), the mean completion length and the held-out implicit-reward metrics. Light
    on purpose: the config checks ``promotion.metric`` and a sweep's objective against it."""
    answers = per_prompt_metric_names(pass_ks, num_samples, reward_model)
    with_ci = [f"{name}{suffix}" for name in answers for suffix in ("", "_ci_low", "_ci_high")]
    return [*with_ci, "mean_completion_tokens", *PREFERENCE_METRICS]


def exact_match(completion: str, answer: str) -> bool:
    """The built-in task's verifier: equal after stripping surrounding whitespace."""
    return completion.strip() == answer.strip()


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al., 2021, arXiv:2107.03374) from ``n`` samples of which ``c`` are correct:

        pass@k = 1 − C(n − c, k) / C(n, k)

    the probability that at least one of ``k`` samples drawn without replacement is correct.
    """
    if not 0 < k <= n:
        raise ValueError(f"pass@k needs 0 < k <= n, got k={k}, n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"correct count c={c} outside 0..{n}")
    return 1.0 - comb(n - c, k) / comb(n, k)


def bootstrap_ci(
    values: list[float], seed: int, resamples: int = 1000, confidence: float = 0.95
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of per-prompt ``values`` (seeded, reproducible)."""
    data = np.asarray(values, dtype=np.float64)
    if data.size == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = data[rng.integers(0, data.size, size=(resamples, data.size))].mean(axis=1)
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return float(low), float(high)
