"""Name → implementation registries filled by a decorator (preference losses, GRPO losses, rewards)."""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(dict[str, T], Generic[T]):
    """A dict of named implementations. ``kind`` names an entry in errors; ``option`` names the
    config field that selects one (``unknown loss_type 'x'``)."""

    def __init__(self, kind: str, option: str):
        super().__init__()
        self.kind, self.option = kind, option

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(implementation: T) -> T:
            if name in self:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self[name] = implementation
            return implementation

        return decorator

    def lookup(self, name: str) -> T:
        if name not in self:
            raise ValueError(f"unknown {self.option} {name!r}; registered: {sorted(self)}")
        return self[name]
