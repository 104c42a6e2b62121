"""A file with one huge row is prepared in memory that grows with the lengths kept, not with the
row (``trainers/data/clipping.py``): measured in fresh processes by ``benchmarks/big_row_memory.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # two subprocesses, one of which takes a gigabyte

PROJECT = Path(__file__).resolve().parents[1]


def test_a_2_mb_prompt_is_prepared_in_bounded_memory():
    command = [sys.executable, "benchmarks/big_row_memory.py", "--megabytes", "2", "--json"]
    done = subprocess.run(command, cwd=PROJECT, capture_output=True, text=True, check=True)
    clipped, whole = (json.loads(line) for line in done.stdout.splitlines())
    assert clipped["mode"] == "clipped" and clipped["rows"] == whole["rows"] == {"sft": 61}
    # the bound: 1.5 GB for a 50 MB row; proportionally 60 MB for 2 MB
    assert clipped["peak_mib"] - clipped["before_mib"] < 60
    assert whole["peak_mib"] - whole["before_mib"] > 200  # tokenized whole it takes ~400 MB: the bound can fail
