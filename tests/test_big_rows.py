"""A file with one huge row is prepared in memory that grows with the lengths kept, not with the
row (``trainers/clipping.py``): measured in fresh processes by ``benchmarks/big_row_memory.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # two subprocesses, one of which takes a gigabyte

PROJECT = Path(__file__).resolve().parents[1]


def test_a_5_mb_prompt_is_prepared_in_bounded_memory():
    command = [sys.executable, "benchmarks/big_row_memory.py", "--megabytes", "5", "--json"]
    done = subprocess.run(command, cwd=PROJECT, capture_output=True, text=True, check=True)
    clipped, whole = (json.loads(line) for line in done.stdout.splitlines())
    assert clipped["mode"] == "clipped" and clipped["rows"] == whole["rows"] == {"sft": 61}
    # the bound: 1.5 GB for a 50 MB row; proportionally 150 MB for 5 MB
    assert clipped["peak_mib"] - clipped["before_mib"] < 150
    assert whole["peak_mib"] - whole["before_mib"] > 500  # tokenized whole it takes ~1 GB: the bound can fail
