"""The layers stay layers: what each package may import, a config import that stays cheap, and a
flow that names no stage."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.fingerprints import imported_modules
from trainers.stages import STAGES

PROJECT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "prefect", "mlflow", "datasets")


def forbidden_imports(path: Path, forbidden: set[str]) -> set[str]:
    imported = imported_modules(ast.parse(path.read_text()))
    return {m for m in imported if any(m == f or m.startswith(f + ".") for f in forbidden)}


def test_validating_a_config_imports_no_torch_transformers_prefect_or_mlflow():
    probe = (
        "import json, sys; from infra.config import load_config; load_config('configs/default.yaml'); "
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=PROJECT, capture_output=True, text=True, check=True)
    assert json.loads(result.stdout) == []


@pytest.mark.parametrize(
    "paths, forbidden",
    [
        ("trainers/**/*.py", {"prefect", "mlflow", "tasks", "flows", "infra"}),  # pure ML, usable from a plain script
        ("tasks/**/*.py", {"flows", "infra.ops"}),
        ("infra/[cs]*.py", {"infra.ops", "tasks", "flows", *HEAVY}),  # the bottom half: config, settings
    ],
)
def test_each_layer_imports_only_the_layers_below_it(paths, forbidden):
    checked = sorted(PROJECT.glob(paths))
    assert checked
    for path in checked:
        assert not forbidden_imports(path, forbidden), path


def test_the_experiment_flow_names_no_stage():
    tree = ast.parse((PROJECT / "flows" / "pipeline.py").read_text())
    strings = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    assert not strings & set(STAGES)
