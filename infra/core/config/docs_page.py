"""The configuration reference, generated from the schema.

:func:`reference_markdown` walks pydantic's ``model_fields`` of :class:`ExperimentConfig` (and of
:class:`EvaluationRequest`, the standalone evaluation's parameter) and returns one markdown section
per config section: every field's key path, type, default, constraints (bounds, choices, the
entries of a registry) and description; nested sections are walked recursively. Run

    python -m infra.core.config.docs_page

to write ``docs/configuration.md`` (``tests/test_docs.py`` checks the committed page equals this).
No torch: the config modules stay light.
"""

from __future__ import annotations

import re
import sys
import types
import typing
from pathlib import Path
from typing import AbstractSet, Any, Literal, Union, get_args, get_origin

import annotated_types
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from infra.core.config import EvaluationRequest, ExperimentConfig
from trainers.registry import RegisteredName

COMMAND = "python -m infra.core.config.docs_page"
DOCS_PATH = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"

_BOUNDS = (
    (annotated_types.Ge, "ge", "≥"),
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Le, "le", "≤"),
    (annotated_types.Lt, "lt", "<"),
)


def _cell(text: str) -> str:
    """Text for one table cell: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _is_none(annotation: Any) -> bool:
    return annotation is type(None)


def _unwrap(annotation: Any) -> tuple[Any, list[Any]]:
    """``Annotated[T, m…]`` → ``(T, [m…])`` (nested Annotated flattened)."""
    metadata: list[Any] = []
    while get_origin(annotation) is typing.Annotated:
        annotation, *extra = get_args(annotation)
        metadata.extend(extra)
    return annotation, metadata


def _members(annotation: Any) -> list[Any]:
    """The alternatives of a union (``A | B``, ``Optional[A]``), else ``[annotation]``."""
    annotation, _ = _unwrap(annotation)
    if get_origin(annotation) in (Union, types.UnionType):
        return list(get_args(annotation))
    return [annotation]


def _section_of(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds directly (``Section`` or ``Section | None``), walked inline."""
    members = [m for m in _members(annotation) if not _is_none(m)]
    if len(members) == 1 and isinstance(members[0], type) and issubclass(members[0], BaseModel):
        return members[0]
    return None


def _models_inside(annotation: Any) -> list[type[BaseModel]]:
    """Models anywhere in a field's type (``Source | list[Source]``), documented once each."""
    annotation, _ = _unwrap(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    for arg in get_args(annotation):
        for model in _models_inside(arg):
            if model not in found:
                found.append(model)
    return found


def _type_name(annotation: Any) -> str:
    annotation, metadata = _unwrap(annotation)
    if any(isinstance(m, RegisteredName) for m in metadata):
        return "str"
    origin = get_origin(annotation)
    if origin is Literal:
        kinds = sorted({type(value).__name__ for value in get_args(annotation)})
        return " \\| ".join(kinds)
    if origin in (Union, types.UnionType):
        names: list[str] = []
        for member in get_args(annotation):
            name = "null" if _is_none(member) else _type_name(member)
            if name not in names:
                names.append(name)
        return " \\| ".join(names)
    if origin in (list, tuple, set):
        return f"list[{', '.join(_type_name(arg) for arg in get_args(annotation)[:1])}]"
    if origin is dict:
        key, value = get_args(annotation)
        return f"dict[{_type_name(key)}, {_type_name(value)}]"
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation)


def _constraints_of(metadata: list[Any], text: bool = False) -> list[str]:
    found: list[str] = []
    for item in metadata:
        if isinstance(item, FieldInfo):
            found.extend(_constraints_of(list(item.metadata), text))
        for kind, attribute, sign in _BOUNDS:
            if isinstance(item, kind):
                found.append(f"{sign} {getattr(item, attribute)}")
        if isinstance(item, annotated_types.MinLen):
            unit = "character" if text else "item"
            found.append(f"at least {item.min_length} {unit}{'s' if item.min_length != 1 else ''}")
        if isinstance(item, annotated_types.MaxLen):
            found.append(f"at most {item.max_length} items")
        if isinstance(item, RegisteredName):
            found.append(f"registered {item.registry.option}: {', '.join(f'`{n}`' for n in sorted(item.registry))}")
        pattern = getattr(item, "pattern", None)
        if isinstance(pattern, str):
            found.append(f"matches `{pattern}`")
    return found


def _constraints(field: FieldInfo) -> str:
    """Bounds, lengths, patterns, choices and registry entries, from the field and its type."""
    found = _constraints_of(list(field.metadata), text=_unwrap(field.annotation)[0] is str)
    seen_literals: list[str] = []
    open_choices = False  # a literal beside another type (`bool | Literal["auto"]`): "or `auto`"

    def walk(annotation: Any, inner: bool) -> None:
        nonlocal open_choices
        annotation, metadata = _unwrap(annotation)
        for text in _constraints_of(metadata):
            text = f"each {text}" if inner and not text.startswith("registered") else text
            if text not in found:
                found.append(text)
        origin = get_origin(annotation)
        if origin is Literal:
            for value in get_args(annotation):
                choice = f"`{value}`" if isinstance(value, str) else f"`{_yaml(value)}`"
                if choice not in seen_literals:
                    seen_literals.append(choice)
        elif origin in (Union, types.UnionType):
            members = get_args(annotation)
            kinds = {get_origin(_unwrap(m)[0]) is Literal for m in members if not _is_none(m)}
            open_choices = open_choices or kinds == {True, False}
            for member in members:
                walk(member, inner)
        elif origin in (list, tuple, set, dict):
            for arg in get_args(annotation):
                walk(arg, True)

    walk(field.annotation, False)
    if seen_literals:
        found.insert(0, f"{'or' if open_choices else 'one of'} {', '.join(seen_literals)}")
    return "; ".join(found)


def _yaml(value: Any) -> str:
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, allow_unicode=True, width=10_000)
    return text.strip().removesuffix("...").strip()


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    return f"`{value}`" if isinstance(value, str) else f"`{_yaml(value)}`"


def _title(model: type[BaseModel]) -> str:
    """The first paragraph of the model's docstring, reST roles and double backticks made markdown."""
    text = (model.__doc__ or "").strip().split("\n\n")[0]
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


class _Page:
    """Collects the markdown; shared models (a dataset source) are written once per page."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.shared: list[tuple[str, type[BaseModel]]] = []
        self.used_by: dict[type[BaseModel], list[str]] = {}

    def table(self, model: type[BaseModel], prefix: str, skip: AbstractSet[str] = frozenset()) -> None:
        """One row per scalar field of ``model``; nested sections follow as their own tables."""
        nested: list[tuple[str, FieldInfo, type[BaseModel]]] = []
        rows: list[str] = []
        for name, field in model.model_fields.items():
            if name in skip:
                continue
            key = f"{prefix}{name}"
            section = _section_of(field.annotation)
            if section is not None:
                nested.append((key, field, section))
                continue
            for inner in _models_inside(field.annotation):
                if inner not in [m for _, m in self.shared]:
                    self.shared.append((inner.__name__, inner))
                self.used_by.setdefault(inner, []).append(f"`{key}`")
            rows.append(
                f"| `{key}` | {_type_name(field.annotation)} | {_cell(_default(field))} | "
                f"{_cell(_constraints(field))} | {_cell(field.description or '')} |"
            )
        if rows:
            self.lines += ["| key | type | default | constraints | description |", "|---|---|---|---|---|", *rows, ""]
        for key, field, section in nested:
            self.section(key, field, section, level=4 if prefix.count(".") else 3)

    def section(self, key: str, field: FieldInfo, model: type[BaseModel], level: int) -> None:
        optional = any(_is_none(m) for m in _members(field.annotation))
        self.lines += [f"{'#' * level} `{key}`", ""]
        about = field.description or _title(model)
        if about:
            self.lines += [_cell(about), ""]
        default = _default(field) if field.default_factory is None else None
        notes = []
        if optional:
            notes.append(f"`null` turns it off (default: {default or 'on, with the values below'}).")
        if notes:
            self.lines += [" ".join(notes), ""]
        self.table(model, f"{key}.")


def reference_markdown() -> str:
    """The configuration reference as markdown: the text of ``docs/configuration.md``."""
    page = _Page()
    page.lines += [
        "# Configuration reference",
        "",
        "<!-- Generated from the schema by `" + COMMAND + "`: do not edit by hand. -->",
        "",
        "Generated from the pydantic schema (`ExperimentConfig`, `infra/core/config`). After changing a",
        f"field, regenerate this page with `{COMMAND}` (`tests/test_docs.py` fails while it is stale).",
        "How loading and overrides work: [README](../README.md#configuration-at-a-glance); what is checked",
        "at load time: [operations](operations-and-recovery.md#bad-input); cross-field rules (a loss",
        "hyperparameter no chosen loss reads, batch arithmetic, …) are on the topic pages ([index](README.md)).",
        "",
        "Keys are dotted as in overrides (`alignflow run configs/default.yaml dpo.beta=0.2`). Defaults",
        "are the schema's; `configs/default.yaml` sets some differently.",
        "",
        "## Experiment (`ExperimentConfig`)",
        "",
        _cell(_title(ExperimentConfig)),
        "",
        "### Top level",
        "",
    ]
    page.table(ExperimentConfig, "")
    experiment_sections = {
        name for name, field in ExperimentConfig.model_fields.items() if _section_of(field.annotation) is not None
    }
    shared_sections = [
        name
        for name, field in EvaluationRequest.model_fields.items()
        if name in experiment_sections
        and _section_of(field.annotation) is _section_of(ExperimentConfig.model_fields[name].annotation)
    ]
    page.lines += [
        "## Standalone evaluation (`EvaluationRequest`)",
        "",
        _cell(_title(EvaluationRequest))
        + " The parameter of `flows/evaluation.py` (`alignflow evaluate`, `configs/evaluate.yaml`).",
        "",
    ]
    if shared_sections:
        page.lines += [
            "Its sections "
            + ", ".join(f"`{name}`" for name in shared_sections)
            + " are the experiment's, documented above.",
            "",
        ]
    page.table(EvaluationRequest, "", skip=set(shared_sections))
    written: set[type[BaseModel]] = set()
    while len(written) < len(page.shared):
        name, model = next((n, m) for n, m in page.shared if m not in written)
        written.add(model)
        about = " ".join(x for x in (_cell(_title(model)), f"Used by {', '.join(page.used_by[model])}.") if x)
        page.lines += [f"## Shared type `{name}`", "", about, ""]
        page.table(model, "")
    return "\n".join(page.lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    path = Path((argv or sys.argv[1:] or [str(DOCS_PATH)])[0])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(reference_markdown(), encoding="utf-8")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
