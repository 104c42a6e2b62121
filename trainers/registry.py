"""Name → implementation registries filled by a decorator (preference losses, GRPO losses, reward
scales, rewards, stages).

A registry also gives the config schema its choice type, ``Annotated[str, RegisteredName(registry)]``:
a string checked against the entries registered *when the config is validated*, so entries that a
plugin module registers are accepted, and listed in the Prefect UI form when the schema is generated.
"""

from __future__ import annotations

from typing import Any, Callable, Generic, TypeVar

from pydantic import GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic_core import core_schema

T = TypeVar("T")


class Registry(dict[str, T], Generic[T]):
    """A dict of named implementations. ``kind`` names an entry in errors; ``option`` names the
    config field that selects one (``unknown loss_type 'x'``)."""

    def __init__(self, kind: str, option: str):
        super().__init__()
        self.kind, self.option = kind, option

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(implementation: T) -> T:
            self.add(name, implementation)
            return implementation

        return decorator

    def add(self, name: str, implementation: T) -> None:
        if name in self:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self[name] = implementation

    def lookup(self, name: str) -> T:
        if name not in self:
            raise ValueError(f"unknown {self.option} {name!r}; registered: {sorted(self)}")
        return self[name]

    def check(self, name: str) -> str:
        self.lookup(name)
        return name


class RegisteredName:
    """Pydantic marker: the string must name an entry of ``registry``; its JSON schema lists the
    entries (an ``enum``, rendered as a select by the Prefect UI)."""

    def __init__(self, registry: Registry):
        self.registry = registry

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(self.registry.check, handler(source))

    def __get_pydantic_json_schema__(self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler) -> dict:
        json_schema = handler(schema)
        json_schema["enum"] = sorted(self.registry)
        return json_schema
