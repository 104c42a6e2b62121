"""The launch seam: what a training stage is given (:class:`TrainInputs`), where it keeps its files
(:class:`StageFolder`), and the one description of a job launched over several processes
(:data:`LaunchSpec`, written by the task, read by every rank, with the result rank 0 returns).

A launched job runs ``python -m accelerate.commands.launch … -m tasks.launched_rank <spec.json>``;
the parent side (write the spec, launch, stream the output, collect the result or the failed
rank's error) is :mod:`tasks.launch`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Iterator, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, TypeAdapter, model_validator

from infra.core.config import AdditionTaskConfig, ComputeConfig, EvaluationConfig
from infra.core.fingerprints import staging_copies
from infra.core.handles import ModelHandle, PreparedData, ReferenceLogps
from infra.core.settings import get_settings
from trainers.catalog import STAGES, StageName
from trainers.models.lora import LoraSettings
from trainers.plugins import import_plugins
from trainers.scoring.metrics import ModelScores
from trainers.sections import TrainingConfig


@dataclass(frozen=True)
class TrainInputs:
    """A stage's inputs as handles: the model it starts from (also its reference), the prepared
    data and, for a stage that reads them, the reference log-prob cache entry."""

    policy: ModelHandle
    data: PreparedData
    reference_logps: ReferenceLogps | None = None
    lora: LoraSettings | None = None  # train LoRA adapters (``peft.for_stage``) instead of every weight
    compute: ComputeConfig = ComputeConfig()  # noqa: RUF009 (frozen): load dtype, mixed precision, processes
    reward_models: dict[str, ModelHandle] = field(default_factory=dict)  # earlier reward stages' models, by stage
    teacher: ModelHandle | None = None  # a distillation stage's frozen teacher


class StageFolder(BaseModel):
    """``outputs/<config name>/<stage>-<key>``: a stage's checkpoints, final model and MLflow run id.
    For a training stage the key hashes what its model is a function of (``tasks.train.stage_key``),
    so an identical rerun finds what the run before it left. The one definition of its layout."""

    model_config = ConfigDict(frozen=True)

    path: Path

    MODEL: ClassVar[str] = "model"  # the final model; with LoRA the merged copy
    ADAPTER: ClassVar[str] = "adapter"  # with LoRA: the adapter
    FINISHED: ClassVar[str] = "model.json"  # the final model's handle, written last: the stage is finished
    RUN_ID: ClassVar[str] = "mlflow_run_id"  # the stage's MLflow run, reused by a retry or a resume
    LOCK: ClassVar[str] = ".lock"
    LAUNCH: ClassVar[str] = "launch"  # a launched stage's spec, its ranks' errors and rank 0's result
    CHECKPOINTS: ClassVar[str] = "checkpoint-*"

    @classmethod
    def of(cls, config_name: str, stage: str, key: str) -> StageFolder:
        return cls(path=get_settings().outputs / config_name / f"{stage}-{key}")

    @classmethod
    def of_run(cls, config_name: str, stage: str, run_id: str) -> StageFolder:
        """The folder of ``stage`` whose MLflow run is ``run_id``."""
        for folder in cls.under(get_settings().outputs / config_name, f"{stage}-*"):
            if folder.recorded_run_id() == run_id:
                return folder
        raise FileNotFoundError(f"no {stage} output folder of MLflow run {run_id} under outputs/{config_name}")

    @classmethod
    def under(cls, root: Path, pattern: str = "**") -> Iterator[StageFolder]:
        """Every stage folder (one that holds a run-id file) below ``root`` matching ``pattern``."""
        if root.is_dir():
            yield from (cls(path=id_file.parent) for id_file in sorted(root.glob(f"{pattern}/{cls.RUN_ID}")))

    @property
    def model_dir(self) -> Path:
        return self.path / self.MODEL

    @property
    def adapter_dir(self) -> Path:
        return self.path / self.ADAPTER

    @property
    def finished_file(self) -> Path:
        return self.path / self.FINISHED

    @property
    def run_id_file(self) -> Path:
        return self.path / self.RUN_ID

    @property
    def lock_file(self) -> Path:
        return self.path / self.LOCK

    @property
    def launch_dir(self) -> Path:
        return self.path / self.LAUNCH

    def recorded_run_id(self) -> str | None:
        return self.run_id_file.read_text().strip() if self.run_id_file.is_file() else None

    def checkpoints(self) -> list[Path]:
        return sorted(p for p in self.path.glob(self.CHECKPOINTS) if p.is_dir())

    def model_stagings(self) -> list[Path]:
        """Copies of ``model/`` being written, left behind by a process killed while it wrote one."""
        return staging_copies(self.model_dir)


# Set by the parent side to the launch's start (Unix time): each machine's first rank reports how
# long it took to start (``tasks.launched_rank``).
LAUNCHED_AT = "ALIGNFLOW_LAUNCHED_AT"


class LaunchedJob(BaseModel):
    """What every launched job says: the plugins imported first, the folder of its spec, errors and
    result, and (:attr:`compute`) the processes it runs on; a launch that silently ran fewer fails."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    plugins: tuple[str, ...]
    launch_dir: Path

    SPEC: ClassVar[str] = "spec.json"
    RESULT: ClassVar[str] = "result.json"
    result: ClassVar[type[BaseModel]]

    if TYPE_CHECKING:
        # Each job kind has its compute section: a field, or its inputs'.
        @property
        def compute(self) -> ComputeConfig: ...

    @model_validator(mode="before")
    @classmethod
    def _import_plugins(cls, data: Any) -> Any:
        """Before the fields are read: a section may name the rewards and losses they define."""
        if isinstance(data, dict) and "plugins" in data:
            import_plugins(data["plugins"])
        return data

    @property
    def world_size(self) -> int:
        return self.compute.num_processes

    @property
    def spec_file(self) -> Path:
        return self.launch_dir / self.SPEC

    @property
    def result_file(self) -> Path:
        return self.launch_dir / self.RESULT


class TrainResult(BaseModel):
    world_size: int
    log_history: list[dict[str, Any]]


class TrainJob(LaunchedJob):
    """Train ``stage`` from ``checkpoint`` (or its start) into ``model_dir``; rank 0 tracks MLflow run
    ``run_id`` (None: nothing is tracked). ``final``: the checkpoint is the last step's, only its model is saved."""

    job: Literal["train"] = "train"
    stage: StageName
    section: SerializeAsAny[TrainingConfig]
    inputs: TrainInputs
    folder: StageFolder
    model_dir: Path
    run_id: str | None
    log_checkpoints: Literal["all", "final", "none"]
    checkpoint: Path | None
    final: bool

    result: ClassVar[type[BaseModel]] = TrainResult

    @property
    def compute(self) -> ComputeConfig:
        return self.inputs.compute

    @model_validator(mode="before")
    @classmethod
    def _section_of_the_stage(cls, data: Any) -> Any:
        """The stage's own section type (after the plugins its rewards may come from)."""
        if isinstance(data, dict) and {"stage", "section", "plugins"} <= data.keys() and data["stage"] in STAGES:
            import_plugins(data["plugins"])
            data = data | {"section": STAGES[data["stage"]].section.model_validate(data["section"])}
        return data


class RowsJob(LaunchedJob):
    """A job over prepared rows (a ``save_to_disk`` folder of splits) whose models are loaded in
    ``compute.dtype`` on each process's device."""

    splits: Path
    compute: ComputeConfig


class ModelJob(RowsJob):
    """A job over one model: a folder or hub id at ``revision``."""

    model: str
    revision: str | None


class ReferenceResult(BaseModel):
    world_size: int
    columns: dict[
        str, tuple[list[float], list[float]]
    ]  # split -> its rows' two log-probs (chosen, rejected), in row order


class ReferenceJob(ModelJob):
    """Reference log-probs of the splits of the reference view ``view`` (``trainers.scoring.reference_views``)
    of ``splits``, their batches sharded over the processes (``tasks.reference`` when
    ``compute.num_processes > 1``)."""

    job: Literal["reference"] = "reference"
    view: str
    batch_size: int = Field(ge=1)

    result: ClassVar[type[BaseModel]] = ReferenceResult


class EvaluateResult(BaseModel):
    model_config = ConfigDict(ser_json_inf_nan="constants")  # a NaN metric comes back as NaN, not null

    world_size: int
    scores: list[ModelScores]  # one per model of the job, in its order; on vLLM maybe the first ones only


class EvaluatedModel(BaseModel):
    """One model of an :class:`EvaluateJob`: a folder or hub id at ``revision``; ``pairs``: scored on
    the held-out pairs too (not the reference itself, whose implicit reward is 0 by definition)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str
    revision: str | None
    pairs: bool


class EvaluateJob(RowsJob):
    """The evaluation (``trainers.evaluation.evaluate.evaluate_model``) of each of ``models`` in turn, in one
    launch, on the :attr:`PROMPTS` and :attr:`PAIRS` splits of ``splits`` (either may be absent),
    sharded over the processes (``tasks.evaluate`` when ``compute.num_processes > 1``). On vLLM the
    result may hold fewer scores than models: the launch ends at the first model of another shape
    than its engine's (``tasks.launched_rank.evaluate``)."""

    job: Literal["evaluate"] = "evaluate"
    models: list[EvaluatedModel] = Field(min_length=1)
    evaluation: EvaluationConfig
    beta: float | None
    reward_model: ModelHandle | None = None  # scores the samples (``evaluation.reward_model``, resolved)
    chat_template: str | None = None  # over the models' tokenizers' (``Scoring.chat_template``)
    builtin: AdditionTaskConfig | None = None  # ``data.builtin``: the documents of ``builtin:addition`` suites

    PROMPTS: ClassVar[str] = "prompts"  # held-out prompts with answers
    PAIRS: ClassVar[str] = "pairs"  # held-out pairs with their reference log-probs

    result: ClassVar[type[BaseModel]] = EvaluateResult


LaunchSpec = Annotated[Union[TrainJob, ReferenceJob, EvaluateJob], Field(discriminator="job")]
LAUNCH_SPEC: TypeAdapter[LaunchSpec] = TypeAdapter(LaunchSpec)


def read_spec(path: Path) -> LaunchSpec:
    return LAUNCH_SPEC.validate_json(path.read_text())
