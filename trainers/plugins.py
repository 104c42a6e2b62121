"""Plugins: modules a config names to be imported before anything reads it, so that the losses and
rewards they register (or the reward functions named by import path) may be used."""

from __future__ import annotations

import importlib
from typing import Iterable

from trainers.rewards import allow_module


def import_plugins(modules: Iterable[str]) -> None:
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise ValueError(
                f"plugins: cannot import {module!r}: {error} (a plugin must be importable wherever the config is "
                "read: install its package, or put its folder on PYTHONPATH; the `alignflow` command, like any "
                "console script, does not look in the working directory)"
            ) from None
        allow_module(module)  # reward import paths may name its functions
