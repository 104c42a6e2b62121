"""Reading a config: YAML files, ``key.sub=value`` overrides, and a deployment's defaults under a run's values."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

import yaml

from infra.core.config.errors import yaml_problem
from infra.core.config.schema import ExperimentConfig
from infra.core.config.tree import deep_merge, set_path
from trainers.sections import Section

MAX_DEPTH = 64  # nesting a config never needs, far below Python's recursion limit
MAX_NODES = 100_000  # values, counted with every alias expanded: a "billion laughs" file is refused


MERGE_TAG = "tag:yaml.org,2002:merge"
SectionT = TypeVar("SectionT", bound=Section)


class ConfigLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` for configs: a key given twice in one mapping is an error (not the last
    one silently winning), and so are nesting deeper than :data:`MAX_DEPTH`, a merge key (``<<:``,
    whose keys a later key silently overrides) and a key that is a list or a mapping (``? [1, 2]``)."""

    depth = 0

    def compose_node(self, parent, index):
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, f"nested deeper than {MAX_DEPTH} levels", self.peek_event().start_mark
                )
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if key_node.tag == MERGE_TAG:
                raise yaml.constructor.ConstructorError(
                    None, None, "merge keys (<<) are not supported: write the keys out", key_node.start_mark
                )
            if not isinstance(key_node, yaml.ScalarNode):
                kind = "list" if isinstance(key_node, yaml.SequenceNode) else "mapping"
                raise yaml.constructor.ConstructorError(
                    None, None, f"a key must be a plain value, not a {kind}", key_node.start_mark
                )
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                first = seen[key].line + 1
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice (first on line {first})", key_node.start_mark
                )
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep)


def expanded_size(value: Any, sizes: dict[int, int] | None = None) -> int:
    """How many values ``value`` holds with every alias expanded (shared objects counted each time
    they are reached, each computed once)."""
    sizes = {} if sizes is None else sizes
    if id(value) not in sizes:
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        sizes[id(value)] = 1 + sum(expanded_size(child, sizes) for child in children)
    return sizes[id(value)]


def parse_yaml(text: str) -> Any:
    """A config's YAML: :class:`ConfigLoader`, and at most :data:`MAX_NODES` values once expanded."""
    tree = yaml.load(text, Loader=ConfigLoader)  # noqa: S506 (a SafeLoader)
    if expanded_size(tree) > MAX_NODES:
        raise ValueError(f"more than {MAX_NODES:,} values once its aliases are expanded")
    return tree


def apply_override(tree: dict[str, Any], override: str) -> None:
    """Set ``a.b.c=value`` in a nested dict; the value is parsed as YAML (numbers, lists, null)."""
    key, sep, raw = override.partition("=")
    if not sep or not key:
        raise ValueError(f"override {override!r} is not of the form key.sub=value")
    try:
        value = parse_yaml(raw)
    except ValueError as error:
        raise ValueError(f"override {override!r}: {error}") from None
    except yaml.YAMLError as error:
        raise ValueError(f"override {override!r}: {yaml_problem(error)}") from None
    try:
        set_path(tree, key, value)
    except ValueError as error:
        raise ValueError(f"override {override!r}: {str(error).split(': ', 1)[1]}") from None


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML file; errors name the file (and line and column)."""
    if Path(path).exists() and not Path(path).is_file():  # a folder, or a FIFO that would block the read
        raise ValueError(f"{path}: not a regular file")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text (byte {error.start})") from None
    except OSError as error:
        raise ValueError(f"{path}: {error.strerror}") from None
    try:
        tree = parse_yaml(text)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: {yaml_problem(error)}") from None
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise ValueError(f"{path}: the file must hold a mapping of config keys, not a {type(tree).__name__}")
    return tree


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
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


def merge_onto(config: SectionT, defaults: dict[str, Any]) -> SectionT:
    """The fields set explicitly in ``config`` (at any depth) over ``defaults``, a whole config as a
    dict, validated again. A deployment's run given ``{"dpo": {"beta": 0.2}}`` keeps every other
    default of the deployment, not the schema's (Prefect merges parameters at the top level only)."""
    return type(config).model_validate(deep_merge(defaults, config.model_dump(mode="json", exclude_unset=True)))
