"""How long a generation may run: the :class:`Generation` that a stage sampling while it trains
(:attr:`trainers.stages.spec.StageSpec.generation`) or the evaluation declares, checked
against the model's context (:func:`trainers.data.lengths.config_context`). A leaf module: the
torch-free config sections import it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Generation:
    """Completions sampled from prompts: ``new_tokens`` at most (the value of ``setting``) after each
    prompt, cut to ``max_prompt_length`` when set (by ``prompt_settings``). ``engine_length`` is a
    vLLM engine's own limit when one is set (by ``engine_setting``): the limit where it is shorter
    than the model's context. The stages that sample while they train declare theirs
    (:attr:`trainers.stages.spec.StageSpec.generation`)."""

    new_tokens: int
    setting: str  # e.g. "grpo.max_completion_length"
    max_prompt_length: int | None = None
    prompt_settings: str = "data.max_prompt_length"
    engine_length: int | None = None
    engine_setting: str | None = None

    def check(self, lengths: Iterable[int], context: int | None) -> None:
        """Refuse a generation whose longest prompt (of ``lengths``, as cut) plus :attr:`new_tokens`
        would pass the model's ``context`` (None: unknown) or the engine's length: the last tokens
        would sit at positions the model was never built for, and a vLLM engine would stop there.
        The error names the settings and says how to fix it. Checked before any generation: by the
        experiment flow once the data is prepared (for every stage and the evaluation, before any
        trains), by the GRPO and distillation trainers when they are built, by the evaluation
        before each model's."""
        limit = "the model's context"
        if self.engine_length is not None and (context is None or self.engine_length < context):
            context, limit = self.engine_length, self.engine_setting or "the engine's length"
        cut = self.max_prompt_length
        longest = max((min(n, cut) if cut else n for n in lengths), default=0)
        if context is None or longest + self.new_tokens <= context:
            return
        raise ValueError(
            f"{self.setting.split('.')[0]}: the longest prompt ({longest} tokens) + {self.setting} "
            f"({self.new_tokens}) is {longest + self.new_tokens} tokens, beyond {limit} ({context} positions): "
            f"set {self.setting} to at most {context - longest}, or cut the prompts shorter ({self.prompt_settings})"
        )


def evaluation_generation(max_new_tokens: int) -> Generation:
    """The evaluation's greedy and sampled completions of each held-out prompt."""
    return Generation(new_tokens=max_new_tokens, setting="evaluation.max_new_tokens")
