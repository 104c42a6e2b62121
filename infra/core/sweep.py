"""``SweepConfig``: the schema of a sweep file (``alignflow sweep configs/sweep.yaml``).

A sweep is a base experiment config, a search space over any of its fields (dotted keys, as the
command-line overrides use them), a search strategy and an objective. Each trial's experiment config
is the base with the trial's values written over it, validated by :data:`~infra.core.config.ExperimentConfig`
like any other config. No torch and no Optuna here: a bad sweep file fails at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import Field, ValidationError, model_validator

from infra.core.config import (
    ExperimentConfig,
    SafeName,
    TrackingConfig,
    config_errors,
    read_yaml,
    set_path,
)
from trainers.sections import Section, Seed

# Kept in step with tasks.search.SAMPLERS (which imports Optuna; a test checks both agree).
Strategy = Literal["grid", "random", "tpe"]
STRATEGIES: tuple[Strategy, ...] = get_args(Strategy)
Scalar = str | int | float | bool | None


class Range(Section):
    """A numeric interval for the ``random`` and ``tpe`` strategies (a list of values is a categorical axis)."""

    low: float
    high: float
    log: bool = Field(False, description="Sample on a log scale (low > 0).")
    step: float | None = Field(None, gt=0, description="Discretisation step (not with log).")
    integer: bool = Field(False, description="Whole numbers only.")

    @model_validator(mode="after")
    def _ordered(self) -> Range:
        if not self.low < self.high:
            raise ValueError(f"low ({self.low}) must be less than high ({self.high})")
        if self.log and (self.low <= 0 or self.step is not None):
            raise ValueError("log needs low > 0 and no step")
        return self

    def bounds(self) -> list[float | int]:
        return [int(self.low), int(self.high)] if self.integer else [self.low, self.high]


class Objective(Section):
    metric: str = Field(
        "sampled_accuracy",
        description="Evaluation metric of the trial's final stage (its `final/<metric>`): a built-in score or a "
        "metric of a task of the base's evaluation.suites (`<task>/<metric>/<filter>`).",
    )
    direction: Literal["maximize", "minimize"] = "maximize"


class SweepConfig(Section):
    """A sweep: trials of one base experiment, spread over a Dask cluster, searched by Optuna."""

    name: SafeName = Field(
        "sweep", description="Sweep name: the MLflow sweep run's name; trials are `<name>-<number>`."
    )
    base: dict[str, Any] = Field(
        default_factory=dict,
        description="The base experiment config: a mapping, or (in the file) the path of an experiment YAML.",
    )
    space: dict[str, list[Scalar] | Range] = Field(
        min_length=1, description="Config field (dotted key, e.g. `dpo.beta`) → values, or a Range (random, tpe)."
    )
    strategy: Strategy = Field(
        "grid", description="`grid` (every combination), `random`, or `tpe` (Optuna's model-based sampler)."
    )
    num_trials: int | None = Field(
        None, ge=1, description="Trials to run; grid: at most (default) the number of combinations."
    )
    sampler_seed: Seed = Field(0, description="Seed of the search (grid order, random and TPE draws).")
    objective: Objective = Field(default_factory=Objective)
    max_concurrent: int = Field(2, ge=1, description="Trials running at once (a Prefect concurrency limit).")
    workers: int = Field(2, ge=1, description="Dask worker processes of the local cluster (one trial each).")
    torch_threads: int = Field(1, ge=1, description="Torch threads of each local worker (OMP_NUM_THREADS).")
    address: str | None = Field(None, description="Address of an existing Dask scheduler instead of a local cluster.")
    deployment: str | None = Field(
        None,
        description="Run each trial as a flow run of this experiment deployment (`alignflow-experiment/<name>`) on "
        "its work pool's workers instead of on Dask.",
    )
    promote: bool = Field(
        False, description="Pass the best trial to the promotion gate (the base config's `promotion` settings)."
    )

    @model_validator(mode="before")
    @classmethod
    def _dotted_space(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("space"), dict):
            data = {**data, "space": dotted_axes(data["space"])}
        return data

    @model_validator(mode="after")
    def _strategy_fits_space(self) -> SweepConfig:
        ranges = [key for key, values in self.space.items() if isinstance(values, Range)]
        if self.strategy == "grid" and ranges:
            raise ValueError(f"space.{ranges[0]}: a grid needs a list of values, not a range")
        if self.strategy == "grid" and self.num_trials and self.num_trials > self.grid_size:
            raise ValueError(f"num_trials: {self.num_trials} is more than the grid's {self.grid_size} combinations")
        if self.strategy != "grid" and self.num_trials is None:
            raise ValueError(f"num_trials: strategy {self.strategy!r} needs a number of trials")
        if self.address and self.deployment:
            raise ValueError("address and deployment: give one (a Dask scheduler, or a deployment's work pool)")
        empty = [key for key, values in self.space.items() if values == []]
        if empty:
            raise ValueError(f"space.{empty[0]}: no values")
        return self

    @property
    def grid_size(self) -> int:
        size = 1
        for values in self.space.values():
            size *= len(values) if isinstance(values, list) else 0
        return size

    @property
    def grid_axes(self) -> dict[str, list[Scalar]]:
        """The space of a grid, whose every axis is a list of values (checked when it is loaded)."""
        axes = {}
        for key, values in self.space.items():
            if isinstance(values, Range):
                raise ValueError(f"space.{key}: a grid needs a list of values, not a range")
            axes[key] = values
        return axes

    @property
    def trial_count(self) -> int:
        return self.num_trials or self.grid_size

    # What tasks.tracking.start_parent_run reads of a config: the sweep run lives in the trials' experiment.
    @property
    def run_name(self) -> str:
        return self.name

    @property
    def tracking(self) -> TrackingConfig:
        return ExperimentConfig.model_validate(self.base).tracking

    def trial_tree(self, params: dict[str, Any], number: int, gate: bool = False) -> dict[str, Any]:
        """The experiment config of a trial, as a mapping: the base with ``params`` written over it,
        the run named ``<sweep>-<number>``, and the promotion gate off unless ``gate`` (trials never
        promote; the sweep's ``promote`` passes its best trial to the gate)."""
        tree = dict(self.base)
        for key, value in params.items():
            set_path(tree, key, value)
        set_path(tree, "tracking.run_name", f"{self.name}-{number}")
        if not gate:
            set_path(tree, "promotion.registered_model", None)
        return tree

    def trial_config(self, params: dict[str, Any], number: int, gate: bool = False) -> ExperimentConfig:
        return ExperimentConfig.model_validate(self.trial_tree(params, number, gate))


def dotted_axes(space: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{dpo: {beta: [..]}}`` → ``{"dpo.beta": [..]}``: nested sections (what an override
    ``space.dpo.beta=[..]`` writes) become dotted keys and win over the same key written dotted;
    a mapping with ``low`` / ``high`` is a Range, not a section."""
    flat: dict[str, Any] = {}
    nested: dict[str, Any] = {}
    for key, value in space.items():
        if isinstance(value, dict) and not {"low", "high"} & set(value):
            nested |= dotted_axes(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat | nested


def read_sweep_tree(path: str | Path) -> dict[str, Any]:
    """The sweep file as a mapping, with a ``base:`` path replaced by that file's mapping (so
    overrides such as ``base.sft.max_steps=4`` reach it); errors name the file."""
    tree = read_yaml(path)
    if isinstance(tree.get("base"), str):
        tree["base"] = read_yaml(tree["base"])
    return tree


def trial_errors(spec: SweepConfig, params: dict[str, Any], number: int) -> list[str]:
    """``key: message`` for each problem of the trial's experiment config (none: it is valid)."""
    try:
        spec.trial_config(params, number)
    except ValidationError as error:
        return [f"{key}: {message}" if key else message for key, message in config_errors(error)]
    except ValueError as error:
        return [str(error)]
    return []


def axis_errors(spec: SweepConfig) -> list[str]:
    """Every value of every axis (a range: both ends) on its own over the base, so a bad value is
    reported with its axis before any trial is planned: ``space.dpo.beta=-1: dpo.beta: …``."""
    errors = []
    for key, values in spec.space.items():
        for value in values.bounds() if isinstance(values, Range) else values:
            errors += [f"space.{key}={value}: {problem}" for problem in trial_errors(spec, {key: value}, 0)]
    return errors


def objective_errors(spec: SweepConfig) -> list[str]:
    """The objective must be a metric the base experiment's evaluation produces, and ``promote``
    needs the base's promotion gate."""
    try:
        base = ExperimentConfig.model_validate(spec.base)
    except (ValidationError, ValueError):
        return []  # the base's own problems are reported with each axis value
    errors = []
    if (problem := base.evaluation.metric_problem(spec.objective.metric)) is not None:
        errors.append(f"objective.metric: {problem}")
    if spec.promote and not base.promotion.registered_model:
        errors.append("promote: the base config's promotion.registered_model is not set")
    return errors
