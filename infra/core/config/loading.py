"""Reading a config: YAML files, ``key.sub=value`` overrides, and a deployment's defaults under a run's values."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import yaml

from infra.core.config.errors import yaml_problem
from infra.core.config.schema import ExperimentConfig
from infra.core.config.tree import deep_merge, set_path
from trainers.sections import Section


def apply_override(tree: dict[str, Any], override: str) -> None:
    """Set ``a.b.c=value`` in a nested dict; the value is parsed as YAML (numbers, lists, null)."""
    key, sep, raw = override.partition("=")
    if not sep or not key:
        raise ValueError(f"override {override!r} is not of the form key.sub=value")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as error:
        raise ValueError(f"override {override!r}: {yaml_problem(error)}") from None
    try:
        set_path(tree, key, value)
    except ValueError as error:
        raise ValueError(f"override {override!r}: {str(error).split(': ', 1)[1]}") from None


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML file; errors name the file (and line and column)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text (byte {error.start})") from None
    except OSError as error:
        raise ValueError(f"{path}: {error.strerror}") from None
    try:
        tree = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: {yaml_problem(error)}") from None
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise ValueError(f"{path}: the file must hold a mapping of config keys, not a {type(tree).__name__}")
    return tree


def load_config(
    path: str | Path | None = None,
    overrides: list[str] = (),
    schema: type[Section] | None = None,
    reader: Callable[[str | Path], dict[str, Any]] = read_yaml,
) -> Section:
    """Validate YAML (read by ``reader``) plus ``key.sub=value`` overrides against ``schema`` (default
    ExperimentConfig)."""
    tree: dict[str, Any] = {}
    if path is not None:
        tree = reader(path)
    for override in overrides:
        apply_override(tree, override)
    return (schema or ExperimentConfig).model_validate(tree)


def merge_onto(config: Section, defaults: dict[str, Any]) -> Section:
    """The fields set explicitly in ``config`` (at any depth) over ``defaults``, a whole config as a
    dict, validated again. A deployment's run given ``{"dpo": {"beta": 0.2}}`` keeps every other
    default of the deployment, not the schema's (Prefect merges parameters at the top level only)."""
    return type(config).model_validate(deep_merge(defaults, config.model_dump(mode="json", exclude_unset=True)))
