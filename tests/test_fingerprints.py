"""Cache keys follow the code that produces the content: an edit to a function's source misses
the caches built from it, and only those, with no version constant to bump."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from infra.core.config import AdditionTaskConfig, DataConfig
from infra.core.fingerprints import code_fingerprint, imported_modules
from infra.core.handles import ModelHandle, PreparedData
from tasks.data import data_fingerprint
from tasks.reference import reference_key_inputs
from trainers.catalog import STAGES

PROJECT = Path(__file__).resolve().parents[1]
# The code behind each cache: the reference log-prob cache, prepared data, the cached SFT model.
ROOTS = {"reference": "tasks.reference", "data": "tasks.data", "sft": STAGES["sft"].build.__module__}
PRINT_FINGERPRINTS = (
    "import json, sys; from infra.core.fingerprints import code_fingerprint; "
    "print(json.dumps({name: code_fingerprint(root) for name, root in json.loads(sys.argv[1]).items()}))"
)


def fingerprints_of(tree: Path) -> dict[str, str]:
    """The fingerprints computed by a fresh interpreter on the copy of the project in ``tree``."""
    result = subprocess.run(
        [sys.executable, "-c", PRINT_FINGERPRINTS, json.dumps(ROOTS)],
        cwd=tree,
        env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(result.stdout)


def edit_function(path: Path, function: str, statement: str) -> None:
    """Insert ``statement`` as the first line of ``function``'s body (after its docstring)."""
    source = path.read_text()
    head, sep, body = source.partition(f"def {function}(")
    signature_end = body.index(":\n") + 2
    docstring_end = body.index('"""', body.index('"""', signature_end) + 3) + 4
    path.write_text(head + sep + body[:docstring_end] + f"    {statement}\n" + body[docstring_end:])


@pytest.mark.slow
def test_editing_a_function_misses_exactly_the_caches_built_from_it(tmp_path):
    for package in ("trainers", "tasks"):
        shutil.copytree(PROJECT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    original = fingerprints_of(tmp_path)
    assert original == {name: code_fingerprint(root) for name, root in ROOTS.items()}  # the copy is the checkout

    edit_function(tmp_path / "trainers" / "scoring" / "logprobs.py", "completion_logps", "input_ids = input_ids.long()")
    after_logprobs = fingerprints_of(tmp_path)
    assert after_logprobs["reference"] != original["reference"]  # the reference pass runs completion_logps
    assert after_logprobs["sft"] != original["sft"]  # SFT's loss is completion_logps too (SFTTrainer)
    assert after_logprobs["data"] == original["data"]

    edit_function(tmp_path / "trainers" / "data" / "collators.py", "prompt_completion_batch", "prompts = list(prompts)")
    after_collators = fingerprints_of(tmp_path)
    assert after_collators["reference"] != after_logprobs["reference"]  # both batch with the collators
    assert after_collators["sft"] != after_logprobs["sft"]
    assert after_collators["data"] == original["data"]


@pytest.mark.unit
def test_the_key_of_every_cache_changes_with_the_fingerprint_of_its_code(monkeypatch, tmp_path):
    """Each cache's key is a function of the fingerprint of the code that computes its content,
    rooted where named here: the reference log-probs, the prepared data, a trained stage's model
    (with the plugins it imports), the evaluation's scores and the built-in model's folder."""
    import tasks.data
    import tasks.evaluate
    import tasks.models
    import tasks.reference
    import tasks.train
    from infra.core.config import EvaluationConfig, ModelConfig

    handle = ModelHandle(path="m", fingerprint="f", tokenizer_fingerprint="t", stage="base")
    data = PreparedData(path="d", fingerprint="x", rows={}, dropped={}, token_fingerprints={}, truncation={})
    inputs = tasks.train.TrainInputs(policy=handle, data=data)
    keys = {  # cache: (the module whose code_fingerprint it calls, its key, the roots of its code)
        "reference": (
            tasks.reference,
            lambda: tasks.reference.reference_key(data, handle),
            ("tasks.reference", "trainers.scoring.reference_views"),  # and the view's module
        ),
        "data": (
            tasks.data,
            # fixed lengths: automatic ones read the model's context, and "m" is no model
            lambda: data_fingerprint(
                DataConfig(builtin=AdditionTaskConfig(), max_length=32, max_prompt_length=16), handle
            ),
            ("tasks.data",),
        ),
        "sft": (
            tasks.train,
            lambda: tasks.train.stage_key("sft", STAGES["sft"].section(), inputs, ("alignflow_plugin",)),
            (STAGES["sft"].build.__module__, "alignflow_plugin"),
        ),
        "scores": (
            tasks.evaluate,
            lambda: tasks.evaluate.scores_key(
                handle, data, None, EvaluationConfig(), None, plugins=("alignflow_plugin",)
            ),
            ("tasks.evaluate", "alignflow_plugin"),
        ),
        "builtin model": (
            tasks.models,
            lambda: tasks.models.resolve_model.fn(ModelConfig()),  # its folder (checkpoint_handle below)
            ("trainers.models.builtin",),
        ),
    }
    model_cache = SimpleNamespace(model_cache=tmp_path)
    for cache, (module, key, roots) in keys.items():
        # the built-in model's folder in a model cache of this test's, neither built nor saved
        monkeypatch.setattr(tasks.models, "get_settings", lambda: model_cache)
        monkeypatch.setattr(tasks.models, "save_builtin_model", lambda source, seed, folder: None)
        monkeypatch.setattr(tasks.models, "checkpoint_handle", lambda folder, stage, source: folder)
        before, asked = key(), []
        monkeypatch.setattr(module, "code_fingerprint", lambda *names, asked=asked: asked.append(names) or "edited")
        assert (key() != before, asked) == (True, [roots]), cache
        monkeypatch.undo()
    assert reference_key_inputs(data, handle)["code"] == code_fingerprint(
        "tasks.reference", "trainers.scoring.reference_views"
    )
    assert reference_key_inputs(data, handle, view="kto")["code"] == code_fingerprint(
        "tasks.reference", "trainers.kto.data"
    )
    config = DataConfig(builtin=AdditionTaskConfig(), max_length=32, max_prompt_length=16)
    assert data_fingerprint(config, handle) != data_fingerprint(config.model_copy(update={"max_length": 31}), handle)


@pytest.mark.unit
def test_imports_in_function_bodies_count_and_from_imports_name_submodules():
    import ast

    tree = ast.parse(
        "def build():\n    from trainers.dpo.trainer import DPOTrainer\n    import trainers.data.collators\n"
    )
    assert imported_modules(tree) == {
        "trainers.dpo.trainer",
        "trainers.dpo.trainer.DPOTrainer",
        "trainers.data.collators",
    }
