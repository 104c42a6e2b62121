"""Training stages. Each module here defines one stage's config section and trainer builder and
registers its :class:`~trainers.stages.registry.StageSpec`. ``STAGE_MODULES`` is the list of
stages: adding a stage is a module plus its name here (the order is that of the config sections)."""

import importlib

from trainers.stages.registry import STAGES, ModelSource, StageInputs, StageName, StageSpec

STAGE_MODULES = ("sft", "dpo", "grpo")

for _module in STAGE_MODULES:
    importlib.import_module(f"{__name__}.{_module}")

__all__ = ["STAGES", "ModelSource", "StageInputs", "StageName", "StageSpec"]
