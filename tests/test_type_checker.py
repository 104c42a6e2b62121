"""The type checker sees what the code does: a section field read from a trainer's arguments has
the section's type (``tests/mypy_section_fields.py``), and a wrong field or argument on a typed
spec is an error. mypy runs on the project's cache (``make lint`` fills it), in a process of its own:
in the test process its allocations would make the collector walk every object the tests hold."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

PROJECT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def check(tmp_path: Path, code: str) -> list[str]:
    """mypy's messages on ``code`` (a module importing the project), with the project's settings."""
    module = tmp_path / "typed_use.py"
    module.write_text(code)
    config = str(PROJECT / "pyproject.toml")
    cache = str(PROJECT / ".mypy_cache")
    command = [sys.executable, "-m", "mypy", "--config-file", config, "--cache-dir", cache, str(module)]
    checked = subprocess.run(command, capture_output=True, text=True, cwd=PROJECT)
    assert not checked.stderr, checked.stderr
    lines = checked.stdout.splitlines()
    return [re.sub(r"^.*?typed_use\.py:\d+: ", "", line) for line in lines if "typed_use.py" in line]


def test_a_trainers_arguments_have_their_sections_fields_with_the_sections_types(tmp_path: Path):
    messages = check(
        tmp_path,
        "from trainers.grpo.trainer import GRPOConfig, GRPOTrainer\n"
        "def read(args: GRPOConfig, trainer: GRPOTrainer) -> None:\n"
        "    reveal_type(args.epsilon)\n"
        "    reveal_type(args.generation_seed)\n"
        "    reveal_type(trainer.args.num_generations)\n"
        "    reveal_type(args.loss_type)\n"
        "    reveal_type(args.learning_rate)\n"
        "    args.epsilon_high_typo\n",
    )
    assert messages == [
        'note: Revealed type is "float"',
        'note: Revealed type is "int | None"',
        'note: Revealed type is "int"',
        'note: Revealed type is "str"',  # a registry's name
        'note: Revealed type is "float"',  # TrainingArguments' own, as the section's TrainingConfig has it
        'error: "GRPOConfig" has no attribute "epsilon_high_typo"  [attr-defined]',
    ]


def test_a_wrong_field_or_argument_on_a_typed_spec_is_an_error(tmp_path: Path):
    messages = check(
        tmp_path,
        "from pathlib import Path\n"
        "from infra.core.config.schema import ExperimentConfig\n"
        "from trainers.stages.spec import StageInputs\n"
        "def use(config: ExperimentConfig) -> None:\n"
        "    config.evaluation.num_sample\n"
        "    config.compute.num_processes + 'one'\n",
    )
    assert messages == [
        'error: "EvaluationConfig" has no attribute "num_sample"; maybe "num_samples"?  [attr-defined]',
        'error: Unsupported operand types for + ("int" and "str")  [operator]',
    ]


def test_an_unannotated_override_is_checked_too(tmp_path: Path):
    messages = check(
        tmp_path,
        "from trainers.dpo.trainer import DPOTrainer\n"
        "class Mine(DPOTrainer):\n"
        "    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):\n"
        "        return inputs['input_ids'] * self.args.betta\n",
    )
    assert messages == ['error: "DPOConfig" has no attribute "betta"; maybe "beta"?  [attr-defined]']
