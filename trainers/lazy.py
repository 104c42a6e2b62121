"""A module imported on first attribute access.

The loss registries are read when a config is validated, which must not import torch (a config
error comes back in well under 2 s); their functions use torch only when they run.
"""

from __future__ import annotations

import importlib
from types import ModuleType


class LazyModule:
    """Stands in for ``import name``; the real module is imported when an attribute is first read."""

    def __init__(self, name: str):
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attribute: str):
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attribute)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}>"
