"""The type checker's view of :func:`trainers.sections.section_fields` (a mypy plugin).

The decorator gives a ``TrainingArguments`` subclass the fields of a pydantic section at import
time; mypy cannot run it, so this plugin adds the same attributes, with the section's annotated
types, to the decorated class (the fields ``TrainingConfig`` shares with ``TrainingArguments`` stay
``TrainingArguments``'). ``tests/test_type_checker.py`` checks that it sees what the decorator does.
"""

from __future__ import annotations

from typing import Callable

from mypy.nodes import CallExpr, RefExpr, TypeInfo, Var
from mypy.plugin import ClassDefContext, Plugin
from mypy.plugins.common import add_attribute_to_class

DECORATOR = "trainers.sections.section_fields"
SHARED_BASE = "trainers.sections.TrainingConfig"


def section_fields(section: TypeInfo) -> dict[str, Var] | None:
    """The section's own fields (``TrainingConfig``'s and pydantic's left out), or None while a type
    is not inferred yet."""
    fields: dict[str, Var] = {}
    for info in section.mro:
        if info.fullname == SHARED_BASE:
            break
        for name, symbol in info.names.items():
            node = symbol.node
            if not isinstance(node, Var) or name.startswith("_") or node.is_classvar or name in fields:
                continue
            if node.type is None:
                return None
            fields[name] = node
    return fields


def add_section_fields(ctx: ClassDefContext) -> bool:
    call = ctx.reason
    if not isinstance(call, CallExpr) or not call.args or not isinstance(call.args[0], RefExpr):
        ctx.api.fail("section_fields takes the section class", ctx.reason)
        return True
    section = call.args[0].node
    if not isinstance(section, TypeInfo):
        return False  # not analysed yet: mypy calls again
    fields = section_fields(section)
    if fields is None:
        return False
    for name, var in fields.items():
        if name not in ctx.cls.info.names:
            assert var.type is not None
            add_attribute_to_class(ctx.api, ctx.cls, name, var.type)
    return True


class SectionFieldsPlugin(Plugin):
    def get_class_decorator_hook_2(self, fullname: str) -> Callable[[ClassDefContext], bool] | None:
        return add_section_fields if fullname == DECORATOR else None


def plugin(version: str) -> type[Plugin]:
    return SectionFieldsPlugin
