"""Reward functions for GRPO, registered by name or named by import path.

The contract is TRL's: a reward function is called with keyword arguments only,

    fn(prompts=…, completions=…, completion_ids=…, truncated=…, trainer_state=…, **columns) -> list[float | None]

one value per completion, ``None`` where the function does not apply to that row. ``prompts`` are
the rows' prompts as the data has them: strings, or lists of ``{"role", "content"}`` messages.
``completions`` are the decoded completions, cut at their first stop token: strings for string
prompts, ``[{"role": "assistant", "content": text}]`` for conversational ones. ``completion_ids``
are the sampled token ids, up to and including the stop token of a completion that has one (as
TRL's include the EOS; a truncated completion has none), ``truncated`` whether each completion was
cut at the length limit without a stop token (alignflow's addition: a reward model scores such a
completion as cut), ``trainer_state`` the Trainer's ``TrainerState``, and ``columns`` every other
column of the rows (e.g. ``answer``). Functions must accept ``**kwargs``; a function written for
TRL's ``GRPOTrainer`` runs unchanged. With ``reward_inputs: rendered``, ``prompts`` are the
prompts as the chat template rendered them (special tokens included) and ``completions`` plain
strings, whatever the data's format.

A reward model is named ``model:<stage>`` (a reward stage of the same experiment, e.g.
``model:reward``) or ``model:<path or hub id>``: its one logit scores each prompt and completion
(:class:`trainers.scoring.reward_model.RewardModelScorer`). The stage's builder loads it
(:func:`reward_model_target`); naming it here loads nothing.

An import path is accepted only from a module the user allowed: one listed in the config's
``plugins`` (or a submodule of one), see :func:`allow_module`. Naming a reward never imports
anything else: ``grpo.reward_funcs=[this:x]`` is an error, not ``import this``.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import numbers
import re
import threading
from typing import Any, Literal, Protocol, Sequence

from trainers.data.rows import SOURCE_ROW
from trainers.registry import Registry
from trainers.scoring.metrics import exact_match

RewardInputs = Literal["data", "rendered"]
# keyword arguments every call passes; a data column of one of these names is not passed
RESERVED = ("prompts", "completions", "completion_ids", "truncated", "trainer_state")


class RewardFunction(Protocol):
    def __call__(
        self, *, prompts: list, completions: list, completion_ids: list[list[int]], **kwargs
    ) -> list[float | None]: ...


class RewardError(RuntimeError):
    """A reward function failed or returned something other than one number (or None) per completion."""


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
    """``fn`` must take keyword arguments: it is called with ``prompts``, ``completions``,
    ``completion_ids``, ``trainer_state`` and every data column, as TRL calls it, and ``truncated``."""
    if not callable(fn):
        raise ValueError(f"reward function {name!r} is not callable")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn  # builtins without a signature: trust them
    if not any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
        raise ValueError(
            f"reward function {name!r} has the signature {signature}; it must accept **kwargs: it is called with "
            "the keyword arguments prompts, completions, completion_ids, truncated, trainer_state and every data "
            "column (TRL's contract, docs/algorithms/grpo.md)"
        )
    return fn


REWARD_MODEL_PREFIX = "model:"


def reward_model_target(name: str) -> str | None:
    """The stage name or model path of a ``model:…`` reward; None for any other reward."""
    if not name.startswith(REWARD_MODEL_PREFIX):
        return None
    target = name[len(REWARD_MODEL_PREFIX) :]
    if not target:
        raise ValueError(f"reward {name!r}: name a reward stage (model:reward) or a model path after 'model:'")
    return target


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


def check_reward_names(functions: Sequence[str], weights: Sequence[float] | None = None) -> None:
    """What a config can check without loading a model: every name but ``model:…`` resolves, and
    there is one weight per reward."""
    resolve_rewards([f for f in functions if reward_model_target(f) is None])
    reward_weights(weights, len(functions))


def reward_weights(weights: Sequence[float] | None, count: int) -> list[float]:
    """One weight per reward function, as floats; default: all 1."""
    if weights is None:
        return [1.0] * count
    if len(weights) != count:
        raise ValueError(f"reward_weights has {len(weights)} values for {count} reward_funcs")
    return [float(w) for w in weights]


def resolve_rewards(
    functions: Sequence[str | RewardFunction], weights: Sequence[float] | None = None
) -> tuple[list[tuple[str, RewardFunction]], list[float]]:
    """``(name, function)`` pairs for names, import paths or callables, and one weight each
    (default 1). A ``model:…`` reward comes as a callable (its stage's builder loads it)."""
    named = []
    for f in functions:
        if isinstance(f, str) and reward_model_target(f) is not None:
            raise ValueError(f"reward {f!r} names a reward model: pass it loaded (trainers.scoring.reward_model)")
        named.append(
            (f, get_reward(f)) if isinstance(f, str) else (callable_name(f), check_signature(callable_name(f), f))
        )
    return named, reward_weights(weights, len(named))


def callable_name(fn: RewardFunction) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def text_of(completion: str | list[dict]) -> str:
    """A completion's text: the string, or its messages' contents (TRL's conversational form)."""
    return completion if isinstance(completion, str) else "".join(m["content"] for m in completion)


@register_reward("correctness")
def correctness(completions, answer=None, **kwargs) -> list[float | None]:
    """1 if the completion is exactly the ``answer`` column (surrounding whitespace ignored), else 0;
    ``None`` for rows without an answer. The built-in addition task's verifier."""
    if answer is None:
        raise ValueError("reward 'correctness' needs a dataset column 'answer'")
    return [None if a is None else float(exact_match(text_of(c), str(a))) for c, a in zip(completions, answer)]


INTEGER = re.compile(r"\s*-?\d+\s*")


@register_reward("format")
def integer_format(completions, **kwargs) -> list[float | None]:
    """1 if the completion is a bare integer (the built-in task's answer format), else 0."""
    return [float(INTEGER.fullmatch(text_of(c)) is not None) for c in completions]


@register_reward("length_penalty")
def length_penalty(completion_ids, **kwargs) -> list[float | None]:
    """−(number of sampled completion tokens, the stop token included, as a length penalty written
    for TRL counts them); scale it with its reward weight (e.g. 0.01)."""
    return [-float(len(ids)) for ids in completion_ids]


@register_reward("math_verify")
def math_verify(completions, answer=None, **kwargs) -> list[float | None]:
    """1 if the completion's final answer equals the row's ``answer`` mathematically, else 0; ``None``
    for rows without an answer. Both are parsed by the ``math-verify`` package (LaTeX, ``\\boxed{}``,
    plain expressions and numbers: ``\\frac{1}{2}``, ``0.5`` and ``1/2`` are equal) and compared
    symbolically with sympy: the reward for GSM8K/MATH-style data. Optional dependency:
    ``pip install 'alignflow[math]'``. Its parsing timeouts use ``SIGALRM``, so they apply on the
    main thread only."""
    try:
        from math_verify import parse, verify
    except ImportError:
        raise ValueError("reward 'math_verify' needs the math-verify package: pip install 'alignflow[math]'") from None
    if answer is None:
        raise ValueError("reward 'math_verify' needs a dataset column 'answer'")
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    scores: list[float | None] = []
    for completion, expected in zip(completions, answer):
        if expected is None:
            scores.append(None)
            continue
        gold = parse(str(expected), parsing_timeout=limit)
        found = parse(text_of(completion), parsing_timeout=limit)
        scores.append(float(bool(gold) and verify(gold, found, timeout_seconds=limit)))
    return scores


def reward_kwargs(
    rows: list[dict],
    rendered_prompts: list[str],
    texts: list[str],
    completion_ids: list[list[int]],
    truncated: list[bool],
    inputs: RewardInputs = "data",
) -> dict[str, list]:
    """The keyword arguments of a reward call over ``rows`` (prepared rows) and their decoded
    completions ``texts`` (sampled as ``completion_ids``, ``truncated`` or not), see the module.
    Rows without their source row (tokenized by hand) give the rendered prompts, as
    ``inputs="rendered"`` does, and their own columns."""
    if SOURCE_ROW in rows[0]:
        sources = [json.loads(row[SOURCE_ROW]) for row in rows]
        prompts = [source["prompt"] for source in sources]
    else:
        sources = [{key: value for key, value in row.items() if not key.endswith("_ids")} for row in rows]
        prompts, inputs = rendered_prompts, "rendered"
    completions: list[str] | list[str | list[dict[str, str]]]
    if inputs == "rendered":
        prompts, completions = rendered_prompts, texts
    else:
        completions = [
            [{"role": "assistant", "content": text}] if isinstance(prompt, list) else text
            for prompt, text in zip(prompts, texts)
        ]
    keys = dict.fromkeys(key for source in sources for key in source if key != "prompt" and key not in RESERVED)
    columns = {key: [source.get(key) for source in sources] for key in keys}
    called = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids, "truncated": truncated}
    return called | columns


def score_completions(
    functions: Sequence[tuple[str, RewardFunction]], kwargs: dict[str, Any], trainer_state: Any = None
) -> list[list[float]]:
    """``[function][row]`` rewards, ``NaN`` where a function returned ``None`` (or ``nan``); a
    function that raises, or returns anything but one finite number or None per completion, is a
    :class:`RewardError` naming it."""
    count = len(kwargs["completions"])
    scores = []
    for name, fn in functions:
        try:
            values = fn(**kwargs, trainer_state=trainer_state)
        except Exception as error:
            raise RewardError(f"reward function {name!r} raised {type(error).__name__}: {error}") from error
        if not isinstance(values, (list, tuple)) or len(values) != count:
            got = f"{len(values)} values" if isinstance(values, (list, tuple)) else type(values).__name__
            raise RewardError(f"reward function {name!r} returned {got} for {count} completions")
        bad = next((i for i, v in enumerate(values) if v is not None and not isinstance(v, numbers.Real)), None)
        if bad is not None:
            raise RewardError(
                f"reward function {name!r} returned {values[bad]!r} ({type(values[bad]).__name__}) for completion "
                f"{bad}: rewards are numbers, or None where the function does not apply"
            )
        infinite = next((i for i, v in enumerate(values) if v is not None and math.isinf(v)), None)
        if infinite is not None:
            raise RewardError(
                f"reward function {name!r} returned {values[infinite]} for completion {infinite}: rewards are "
                "finite (None, or nan, where the function does not apply)"
            )
        scores.append([math.nan if v is None else float(v) for v in values])
    return scores
