"""Every training stage, registered: each algorithm package's ``stage`` module builds its trainer
from its config section and registers its :class:`~trainers.stages.spec.StageSpec` (and what else
it brings: KTO its reference view). Import the registries from here (not from
:mod:`trainers.stages.spec` or :mod:`trainers.scoring.reference_views`, which hold only what was
imported so far). Adding a stage is a package with a section and a stage module, and its import below."""

from trainers.scoring.reference_views import REFERENCE_VIEWS
from trainers.stages.spec import STAGES, ModelSource, StageInputs, StageName, StageSpec, stage_curves

# isort: off
# registered in this order, the order of the config's sections (and of the Prefect UI form)
from trainers.sft import stage as sft
from trainers.dpo import stage as dpo
from trainers.grpo import stage as grpo
from trainers.kto import stage as kto
from trainers.reward import stage as reward
from trainers.distill import stage as distill
# isort: on

ALGORITHMS = (sft, dpo, grpo, kto, reward, distill)

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
