"""The sweep's search: Optuna's samplers behind one registry, trials asked and told by number
(no Prefect here). Grid and random plans do not depend on results, so every trial is planned, and
validated, before any runs; a model-based sampler (TPE) asks for each trial when a slot frees up."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import optuna

from infra.core.sweep import Range, SweepConfig, axis_errors, objective_errors, trial_errors

optuna.logging.set_verbosity(optuna.logging.WARNING)


@dataclass(frozen=True)
class SamplerSpec:
    build: Callable[[SweepConfig], optuna.samplers.BaseSampler]
    adaptive: bool  # proposals depend on the results told so far


SAMPLERS: dict[str, SamplerSpec] = {
    "grid": SamplerSpec(
        lambda spec: optuna.samplers.GridSampler(spec.grid_axes, seed=spec.sampler_seed), adaptive=False
    ),
    "random": SamplerSpec(lambda spec: optuna.samplers.RandomSampler(seed=spec.sampler_seed), adaptive=False),
    "tpe": SamplerSpec(
        lambda spec: optuna.samplers.TPESampler(seed=spec.sampler_seed, n_startup_trials=spec.max_concurrent),
        adaptive=True,
    ),
}


@dataclass(frozen=True)
class PlannedTrial:
    number: int
    params: dict[str, Any]
    errors: list[str] = field(default_factory=list)  # problems of its experiment config; empty: valid

    @property
    def label(self) -> str:
        return ", ".join(f"{key}={value}" for key, value in self.params.items())


def suggest(trial: optuna.Trial, key: str, values: list | Range) -> Any:
    if not isinstance(values, Range):
        return trial.suggest_categorical(key, values)
    if values.integer:
        return trial.suggest_int(key, int(values.low), int(values.high), step=int(values.step or 1), log=values.log)
    return trial.suggest_float(key, values.low, values.high, step=values.step, log=values.log)


class Search:
    """One Optuna study (in memory, in the sweep's process) over the sweep's space."""

    def __init__(self, spec: SweepConfig):
        self.spec = spec
        self.study = optuna.create_study(
            direction=spec.objective.direction, sampler=SAMPLERS[spec.strategy].build(spec), study_name=spec.name
        )

    @property
    def adaptive(self) -> bool:
        return SAMPLERS[self.spec.strategy].adaptive

    def ask(self) -> PlannedTrial:
        trial = self.study.ask()
        params = {key: suggest(trial, key, values) for key, values in self.spec.space.items()}
        return PlannedTrial(trial.number, params, trial_errors(self.spec, params, trial.number))

    def tell(self, number: int, value: float | None) -> None:
        """The trial's objective value; None: it failed."""
        try:
            if value is None:
                self.study.tell(number, state=optuna.trial.TrialState.FAIL)
            else:
                self.study.tell(number, value)
        except RuntimeError:
            # GridSampler calls study.stop() once the grid is exhausted, which works inside
            # study.optimize only; the result is stored before that, and the sweep ends by itself.
            if not isinstance(self.study.sampler, optuna.samplers.GridSampler):
                raise


def plan(spec: SweepConfig) -> tuple[Search, list[PlannedTrial]]:
    """The study and the trials known before any runs: all of them for grid and random, none for
    an adaptive sampler (it asks as results come in)."""
    search = Search(spec)
    return search, [] if search.adaptive else [search.ask() for _ in range(spec.trial_count)]


def sweep_errors(spec: SweepConfig, trials: list[PlannedTrial]) -> list[str]:
    """Every problem found before anything runs: the objective, each axis value on its own, then
    each planned trial (``trial 3 (dpo.beta=0.1, seed=2): <key>: <problem>``)."""
    errors = objective_errors(spec) + axis_errors(spec)
    return errors or [f"trial {t.number} ({t.label}): {problem}" for t in trials for problem in t.errors]
