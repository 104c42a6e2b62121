"""Nested dicts addressed by dotted keys (``a.b.c``): what overrides, the top-level seed and
deployment merging write into."""

from __future__ import annotations

from typing import Any


def get_path(tree: dict[str, Any], key: str) -> Any:
    """The value at dotted ``key`` of a nested dict, None where any part is missing."""
    node: Any = tree
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def set_path(tree: dict[str, Any], key: str, value: Any) -> None:
    """Set dotted ``key`` (``a.b.c``) of a nested dict to ``value``, creating the sections on the way
    (new dicts: sections shared with another tree are not changed)."""
    *parents, leaf = key.split(".")
    node = tree
    for part in parents:
        child = node.get(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"{key}: {part!r} is not a section")
        node[part] = node = dict(child)
    node[leaf] = value


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``update`` written over it, nested dicts merged key by key."""
    merged = dict(base)
    for key, value in update.items():
        merged[key] = (
            deep_merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
        )
    return merged
