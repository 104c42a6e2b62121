"""Every training stage, registered: each algorithm package's ``stage`` module builds its trainer
from its config section and registers its :class:`~trainers.stages.spec.StageSpec` (and what else
it brings: KTO its reference view). Import the registries from here (not from
:mod:`trainers.stages.spec` or :mod:`trainers.scoring.reference_views`, which hold only what was
imported so far). Adding a stage is a package with a section and a stage module, and its name in
:data:`ALGORITHMS`."""

import importlib

from trainers.scoring.reference_views import REFERENCE_VIEWS
from trainers.stages.spec import STAGES, ModelSource, StageInputs, StageName, StageSpec, stage_curves

# Registered in this order, the order of the config's sections (and of the Prefect UI form). Imported
# by name: a cache key's code fingerprint (infra.core.fingerprints) follows import statements, and a
# module that reads the registry (data preparation, the flow) does not run the stages' code.
ALGORITHMS = ("sft", "dpo", "grpo", "kto", "reward", "distill")

for _algorithm in ALGORITHMS:
    importlib.import_module(f"trainers.{_algorithm}.stage")

__all__ = [
    "ALGORITHMS",
    "REFERENCE_VIEWS",
    "STAGES",
    "ModelSource",
    "StageInputs",
    "StageName",
    "StageSpec",
    "stage_curves",
]
