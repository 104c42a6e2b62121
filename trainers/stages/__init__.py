"""Training stages. Each module here builds one stage's trainer from its config section (the
torch-free ``trainers/<stage>_section.py``) and registers its
:class:`~trainers.stages.registry.StageSpec`. ``STAGE_MODULES`` is the list of stages: adding a
stage is a section module, a module here and its name below (the order is that of the config
sections)."""

import importlib

from trainers.stages.registry import STAGES, ModelSource, StageInputs, StageName, StageSpec, stage_curves

STAGE_MODULES = ("sft", "dpo", "grpo", "kto", "reward", "distill")

for _module in STAGE_MODULES:
    importlib.import_module(f"{__name__}.{_module}")

__all__ = ["STAGES", "ModelSource", "StageInputs", "StageName", "StageSpec", "stage_curves"]
