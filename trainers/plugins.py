"""Plugins: modules a config names to be imported before anything reads it, so that the losses and
rewards they register (or the reward functions named by import path) may be used."""

from __future__ import annotations

import importlib
import re
from typing import Iterable

from trainers.grpo.rewards import allow_module

MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def import_plugins(modules: Iterable[str]) -> None:
    for module in modules:
        if not isinstance(module, str) or not MODULE_NAME.fullmatch(module):
            raise ValueError(f"plugins: {module!r} is not a module name (absolute and dotted: my_project.rewards)")
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise ValueError(
                f"plugins: cannot import {module!r}: {error} (a plugin must be importable wherever the config is "
                "read: install its package, or put its folder on PYTHONPATH; the `alignflow` command, like any "
                "console script, does not look in the working directory)"
            ) from None
        allow_module(module)  # reward import paths may name its functions
