"""Config error text: one ``(key, message)`` per problem, near matches for unknown keys, and
where in a YAML file it stopped parsing."""

from __future__ import annotations

import difflib
import re
from typing import get_args

import yaml
from pydantic import BaseModel, ValidationError


def yaml_problem(error: yaml.YAMLError) -> str:
    """``line L, column C: <problem>`` of a YAML error (1-based, as editors count)."""
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    problem = getattr(error, "problem", None) or str(error)
    if getattr(error, "context", None) and getattr(error, "problem", None):
        problem = f"{error.context}, {error.problem}"
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark else problem


def section_at(schema: type[BaseModel], path: tuple) -> type[BaseModel] | None:
    """The section model reached by following field names ``path`` from ``schema``."""
    model = schema
    for name in path:
        if isinstance(name, int):  # an item of a list of sections, e.g. data.sft.1
            continue
        field = model.model_fields.get(name) if isinstance(name, str) else None
        if field is None:
            return None
        candidates = [field.annotation, *get_args(field.annotation)]
        found = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if found is None:
            return None
        model = found
    return model


UNION_MEMBER_TAG = re.compile(r"[\w-]+\[.*\]")  # `list[DatasetSource]`, `function-after[…, DatasetSource]`


def error_key(loc: tuple) -> list[str | int]:
    """A pydantic error location without the union members' tags:
    ``data.sft.list[DatasetSource].1.wieght`` → ``data.sft.1.wieght``."""
    return [part for part in loc if isinstance(part, int) or not UNION_MEMBER_TAG.fullmatch(part)]


def config_errors(error: ValidationError) -> list[tuple[str, str]]:
    """``(key, message)`` per problem. A field that takes several shapes (one source or a list of
    them) reports a type mismatch for each shape the input did not take: those are left out when
    the shape it took has its own error at or below the same key."""
    items = [
        (".".join(map(str, error_key(i["loc"]))), i["msg"].removeprefix("Value error, "), i["type"])
        for i in error.errors()
    ]
    specific = [key for key, _, kind in items if not kind.endswith("_type")]

    def shadowed(key: str) -> bool:
        return any(other == key or other.startswith(f"{key}.") for other in specific)

    return [(key, message) for key, message, kind in items if not (kind.endswith("_type") and shadowed(key))]


def did_you_mean(error: ValidationError, schema: type[BaseModel]) -> list[str]:
    """For each unknown key in ``error``, the known keys of its section that look like it."""
    hints = []
    for item in error.errors():
        if item["type"] != "extra_forbidden":
            continue
        loc = error_key(item["loc"])
        *parents, key = loc
        section = section_at(schema, tuple(parents))
        matches = difflib.get_close_matches(str(key), list(section.model_fields) if section else [], n=3)
        if matches:
            where = ".".join(map(str, parents))
            known = ", ".join(f"{where}.{m}" if where else m for m in matches)
            hints.append(f"unknown key {'.'.join(map(str, loc))}: did you mean {known}?")
    return hints
