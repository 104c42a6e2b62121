"""Reward functions for GRPO, registered by name or named by import path.

A reward function is ``fn(prompts, completions, **columns) -> list[float | None]``: one value per
completion, ``None`` where the function does not apply to that row. ``prompts`` and
``completions`` are decoded text (a completion stops before its first EOS); ``columns`` holds
every dataset column of the rows (e.g. ``answer``) plus ``completion_ids`` (token ids, EOS
excluded). Functions must accept ``**columns`` they do not use.

An import path is accepted only from a module the user allowed: one listed in the config's
``plugins`` (or a submodule of one), see :func:`allow_module`. Naming a reward never imports
anything else: ``grpo.reward_funcs=[this:x]`` is an error, not ``import this``.
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
from typing import Protocol, Sequence

from trainers.metrics import exact_match
from trainers.registry import Registry


class RewardFunction(Protocol):
    def __call__(self, prompts: list[str], completions: list[str], **columns) -> list[float | None]: ...


REWARD_FUNCTIONS: Registry[RewardFunction] = Registry("reward function", "reward function")
register_reward = REWARD_FUNCTIONS.register


ALLOWED_MODULES: set[str] = set()
"""Modules (and their submodules) whose functions may be named by import path: the plugins of every
config validated in this process."""


def allow_module(module: str) -> None:
    """Let reward import paths name functions of ``module`` and of its submodules."""
    ALLOWED_MODULES.add(module)


def is_allowed(module: str) -> bool:
    return any(module == allowed or module.startswith(allowed + ".") for allowed in ALLOWED_MODULES)


def check_signature(name: str, fn: RewardFunction) -> RewardFunction:
    """``fn`` must accept ``(prompts, completions, **columns)``."""
    if not callable(fn):
        raise ValueError(f"reward function {name!r} is not callable")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn  # builtins without a signature: trust them
    takes_columns = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    try:
        signature.bind_partial([], [])  # prompts, completions
    except TypeError:
        takes_columns = False
    if not takes_columns:
        raise ValueError(
            f"reward function {name!r} has the signature {signature}; it must accept (prompts, completions, **columns)"
        )
    return fn


def get_reward(name: str) -> RewardFunction:
    """A registered name, or an import path ``package.module:function`` / ``package.module.function``
    of a module allowed by :func:`allow_module` (the config's ``plugins``)."""
    if name in REWARD_FUNCTIONS:
        return check_signature(name, REWARD_FUNCTIONS[name])
    module_name, sep, attribute = name.partition(":") if ":" in name else name.rpartition(".")
    if not sep or not module_name:
        raise ValueError(
            f"unknown reward function {name!r}; registered: "
            f"{sorted(REWARD_FUNCTIONS)}, or give an import path 'module:function' of a module listed in plugins"
        )
    if not is_allowed(module_name):
        raise ValueError(
            f"reward function {name!r}: module {module_name!r} is not listed in plugins; "
            f"registered: {sorted(REWARD_FUNCTIONS)}, or add {module_name!r} to plugins"
        )
    try:
        fn = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"reward function {name!r} cannot be imported: {error}") from None
    return check_signature(name, fn)


def resolve_rewards(
    functions: Sequence[str | RewardFunction], weights: Sequence[float] | None = None
) -> tuple[list[tuple[str, RewardFunction]], list[float]]:
    """``(name, function)`` pairs for names, import paths or callables, and one weight each
    (default 1)."""
    named = [(f, get_reward(f)) if isinstance(f, str) else (f.__name__, f) for f in functions]
    weights = [1.0] * len(named) if weights is None else [float(w) for w in weights]
    if len(weights) != len(named):
        raise ValueError(f"reward_weights has {len(weights)} values for {len(named)} reward_funcs")
    return named, weights


@register_reward("correctness")
def correctness(prompts, completions, answer=None, **columns) -> list[float | None]:
    """1 if the completion is exactly the ``answer`` column (surrounding whitespace ignored), else 0;
    ``None`` for rows without an answer. The built-in addition task's verifier."""
    if answer is None:
        raise ValueError("reward 'correctness' needs a dataset column 'answer'")
    return [None if a is None else float(exact_match(c, a)) for c, a in zip(completions, answer)]


INTEGER = re.compile(r"\s*-?\d+\s*")


@register_reward("format")
def integer_format(prompts, completions, **columns) -> list[float | None]:
    """1 if the completion is a bare integer (the built-in task's answer format), else 0."""
    return [float(INTEGER.fullmatch(c) is not None) for c in completions]


@register_reward("length_penalty")
def length_penalty(prompts, completions, completion_ids, **columns) -> list[float | None]:
    """−(number of completion tokens, EOS excluded); scale it with its reward weight (e.g. 0.01)."""
    return [-float(len(ids)) for ids in completion_ids]


def score_completions(
    functions: Sequence[tuple[str, RewardFunction]],
    prompts: list[str],
    completions: list[str],
    columns: dict[str, list],
) -> list[list[float]]:
    """``[function][row]`` rewards, ``NaN`` where a function returned ``None``."""
    scores = []
    for name, fn in functions:
        values = fn(prompts, completions, **columns)
        if len(values) != len(completions):
            raise ValueError(
                f"reward function {name!r} returned {len(values)} values for {len(completions)} completions"
            )
        scores.append([math.nan if v is None else float(v) for v in values])
    return scores
