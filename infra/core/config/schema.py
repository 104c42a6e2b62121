"""``ExperimentConfig``: the one typed schema of an experiment.

It is loaded from YAML in ``configs/``, overridden from the command line as ``key.sub=value``
(:mod:`infra.core.config.loading`), and is the experiment flow's only parameter (the Prefect UI
renders it as a form). Each training stage's section comes from its registered
:class:`~trainers.catalog.StageSpec`; choice fields are checked against their registries when the
config is validated, so a module listed in ``plugins`` can register more. Importing this module
imports no torch: config errors come back at once.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    Field,
    TypeAdapter,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from infra.core.config.compute import ComputeConfig
from infra.core.config.tree import get_path, set_path
from infra.core.settings import get_settings
from trainers.catalog import STAGES, StageName
from trainers.evaluation.harness import (
    BUILTIN_ADDITION,
    LOCAL_BUILDERS,
    HarnessTask,
    SuiteData,
    SuiteRequest,
    resolve_suite,
    suite_metric_parts,
)
from trainers.models.builtin import BUILTIN_MODELS
from trainers.models.lora import LoraSettings
from trainers.plugins import import_plugins
from trainers.scoring.metrics import evaluation_metric_names, per_prompt_metric_names
from trainers.sections import PaddingFree, Section, Seed, TrainingConfig

BUILTIN_MODEL_NAMES = tuple(BUILTIN_MODELS)
# Suffixes that trainers.data.rows reads as local files (anything else is a `datasets.load_dataset` name).
LOCAL_DATA_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv", ".arrow")
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# A path component is at most 255 bytes; names get suffixes (`<name>-<trial>`, `<stage>-<key>`).
MAX_NAME_LENGTH = 100


def safe_name(value: str) -> str:
    """A name used in paths under the state folder: letters, digits, ``.``, ``_``, ``-``; no ``..``;
    at most :data:`MAX_NAME_LENGTH` characters."""
    if not SAFE_NAME.fullmatch(value) or ".." in value:
        raise ValueError(
            f"{value!r} is not a safe name: use letters, digits, '.', '_' and '-', starting with a letter or "
            "digit, without '..'"
        )
    if len(value) > MAX_NAME_LENGTH:
        raise ValueError(f"a name of {len(value)} characters: at most {MAX_NAME_LENGTH} (it names folders)")
    return value


SafeName = Annotated[str, AfterValidator(safe_name)]


SEED = TypeAdapter(Seed)


def is_template_text(value: str) -> bool:
    """``data.chat_template`` is Jinja text when it has a ``{``, else the path of a file holding it."""
    return "{" in value


def template_file(value: str) -> Path:
    """The file a ``data.chat_template`` path names, symlinks and ``..`` resolved; it must lie in the
    project or a folder of ``ALIGNFLOW_TEMPLATE_DIRS`` (:attr:`Settings.template_roots`), below no hidden
    file or folder of it (``.git``, ``.env``, ``.ssh``: where tools keep state and credentials), and in
    none of :attr:`Settings.state_folders` (the state folder: the servers' credentials)."""
    path = Path(value).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"no such file {value!r} (and not a Jinja template: it has no '{{')")
    settings = get_settings()
    if (state := next((folder for folder in settings.state_folders if path.is_relative_to(folder)), None)) is not None:
        raise ValueError(
            f"{value!r} lies in {state}, a folder of state and credentials: a template file may not come from it"
        )
    roots = [root for root in settings.template_roots if path.is_relative_to(root)]
    if not roots:
        raise ValueError(
            f"{value!r} lies outside the folders a template file may come from "
            f"({', '.join(map(str, settings.template_roots))}): put it in the project, or list its folder in "
            "ALIGNFLOW_TEMPLATE_DIRS"
        )
    hidden = [next((p for p in path.relative_to(root).parts if p.startswith(".")), None) for root in roots]
    if None not in hidden:
        raise ValueError(
            f"{value!r} lies in a hidden file or folder ({hidden[0]!r}), where tools keep state and credentials: "
            "a template file may not come from one"
        )
    return path


def is_local_path(source: str) -> bool:
    """A model source that names a local folder: absolute, relative (``./``, ``../``, ``~``) or with more
    than one ``/`` (a hub id is ``org/name``), or an existing path."""
    return source.startswith(("/", ".", "~")) or source.count("/") > 1 or Path(source).exists()


def is_model_folder(source: str) -> bool:
    """A model source that names a local checkpoint folder (not a built-in, MLflow or hub model)."""
    return not source.startswith(("builtin:", "runs:/", "models:/")) and is_local_path(source)


def check_model_source(source: str) -> str:
    if source.startswith("builtin:"):
        name = source.removeprefix("builtin:")
        if name not in BUILTIN_MODEL_NAMES:
            known = ", ".join(f"builtin:{n}" for n in BUILTIN_MODEL_NAMES)
            raise ValueError(f"unknown built-in model {source!r}; known: {known}")
    elif is_model_folder(source):
        path = Path(source).expanduser()
        if not path.exists():
            raise ValueError(f"model folder {source!r} does not exist")
        if not path.is_dir():
            raise ValueError(f"model source {source!r} is a file; give the checkpoint's folder")
    return source


ModelSource = Annotated[str, AfterValidator(check_model_source)]


def check_source_field(source: str, field: str) -> None:
    """:func:`check_model_source` for a field that also takes other values, its error prefixed with the field."""
    try:
        check_model_source(source)
    except ValueError as error:
        raise ValueError(f"{field}: {error}") from None


class ModelConfig(Section):
    source: ModelSource = Field(
        "builtin:tiny-llama", description="`builtin:tiny-llama`, a Hugging Face model id or a local checkpoint path."
    )
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) for a model id.")
    seed: Seed = Field(0, description="Initialisation seed of a built-in model.")


class AdditionTaskConfig(Section):
    max_operand: int = Field(49, ge=1, description="Operands are drawn from 0..max_operand.")
    noise: float = Field(0.3, ge=0.0, lt=1.0, description="Fraction of SFT demonstrations with a wrong answer.")
    num_eval_problems: int = Field(300, ge=1, description="Held-out problems (eval prompts and eval pairs).")
    seed: Seed = Field(0, description="Seed of the problem split and of the noise.")

    @model_validator(mode="after")
    def _leaves_training_problems(self) -> AdditionTaskConfig:
        problems = (self.max_operand + 1) ** 2
        if self.num_eval_problems >= problems:
            raise ValueError(
                f"num_eval_problems={self.num_eval_problems} leaves no training problems: max_operand="
                f"{self.max_operand} gives {problems}"
            )
        return self


class DatasetSource(Section):
    path: str = Field(
        description="Local .json/.jsonl/.parquet/.csv/.arrow file, a `save_to_disk` folder, "
        "or a `datasets.load_dataset` name."
    )
    name: str | None = Field(None, description="Dataset configuration name (hub datasets).")
    split: str = Field("train", description="Split to read (hub datasets and `save_to_disk` dataset dicts).")
    revision: str | None = Field(None, description="Hub revision of the dataset.")
    columns: dict[str, str] = Field(
        default_factory=dict,
        description="Field -> column of this source, e.g. `{prompt: question, chosen: answer_good}`.",
    )
    weight: float | None = Field(
        None, gt=0, description="Mixing: use round(weight × rows) rows of this source (sampled, seeded by data.seed)."
    )
    num_samples: int | None = Field(
        None, ge=1, description="Mixing: use exactly this many rows of this source (sampled, seeded by data.seed)."
    )

    @model_validator(mode="after")
    def _one_mixing_amount(self) -> DatasetSource:
        if self.weight is not None and self.num_samples is not None:
            raise ValueError(f"data source {self.path}: give weight or num_samples, not both")
        return self

    @field_validator("path")
    @classmethod
    def _local_file_exists(cls, path: str) -> str:
        if path.lower().endswith(LOCAL_DATA_SUFFIXES) and not Path(path).is_file():  # as trainers.data.rows reads it
            what = "is not a regular file" if Path(path).exists() else "does not exist"
            raise ValueError(f"data file {path!r} {what}")
        return path


Sources = DatasetSource | list[DatasetSource] | None


class DataConfig(Section):
    builtin: AdditionTaskConfig | None = Field(
        default_factory=AdditionTaskConfig,
        description="The built-in addition task; it fills every split not given below.",
    )
    sft: Sources = Field(
        None, title="SFT", description="`prompt`/`completion` or `messages` rows for SFT (one source or a list)."
    )
    sft_eval: Sources = Field(
        None, title="SFT eval", description="Held-out SFT rows (same formats as `sft`): SFT's eval_loss."
    )
    preference: Sources = Field(
        None,
        title="Preference",
        description="`prompt`/`chosen`/`rejected` rows, or `chosen`/`rejected` conversations, for DPO.",
    )
    preference_eval: Sources = Field(
        None, title="Preference eval", description="Held-out preference pairs for reward accuracy."
    )
    unpaired: Sources = Field(
        None,
        title="Unpaired",
        description="`prompt`/`completion`/`label` rows (TRL's unpaired format; label true: desirable) for KTO, "
        "which otherwise unpairs `preference`.",
    )
    eval_prompts: Sources = Field(None, title="Eval prompts", description="`prompt`/`answer` rows for accuracy.")
    grpo_prompts: Sources = Field(
        None,
        title="GRPO prompts",
        description=(
            "`prompt` rows for GRPO (every other column, e.g. `answer`, reaches the reward functions); "
            "held-out prompts must not be among them."
        ),
    )
    max_length: Annotated[int, Field(ge=2)] | Literal["auto"] = Field(
        "auto",
        description="Maximum prompt + completion tokens; `auto`: fit 99.5% of every split's rows, rounded up to a "
        "multiple of 8 and capped by the model's context; a fixed value may not exceed that context "
        "(docs/data-and-models.md, lengths).",
    )
    max_prompt_length: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto", description="Maximum prompt tokens; `auto`: fit 99.5% of every split's prompts (as `max_length`)."
    )
    max_cut_share: float = Field(
        0.05,
        ge=0,
        le=1,
        description="Preparation fails when truncation cuts or drops more than this share of a split's rows "
        "(1: accept any cut).",
    )
    truncation_mode: Literal["keep_end", "keep_start", "drop"] = Field(
        "keep_end",
        description="Which end of a too-long prompt to keep (completions keep their start); "
        "`drop` drops every row that does not fit instead of cutting it.",
    )
    chat_template: str | None = Field(
        None,
        description="Chat template for conversational rows, over the tokenizer's: a Jinja string, or a file inside the "
        "project or a folder of `ALIGNFLOW_TEMPLATE_DIRS`.",
    )
    seed: Seed = Field(0, description="Seed of source mixing (`weight` / `num_samples`).")

    @field_validator("chat_template")
    @classmethod
    def _template_file_allowed(cls, value: str | None) -> str | None:
        if value is not None and not is_template_text(value):
            template_file(value)
        return value

    @model_validator(mode="after")
    def _no_empty_source_lists(self) -> DataConfig:
        for split in (name for name, field in type(self).model_fields.items() if field.annotation == Sources):
            if getattr(self, split) == []:
                raise ValueError(f"data.{split}: an empty list of sources (use null for none)")
        return self

    @model_validator(mode="after")
    def _prompt_fits(self) -> DataConfig:
        prompt, total = self.max_prompt_length, self.max_length
        if isinstance(prompt, int) and isinstance(total, int) and prompt >= total:
            raise ValueError(
                f"max_prompt_length ({self.max_prompt_length}) must be less than max_length ({self.max_length}): "
                "no token would be left for the completion"
            )
        return self


class PeftConfig(LoraSettings):
    """LoRA for the training stages: one section, since the target modules are a property of the
    model's architecture, not of a stage; ``stages`` picks the stages that use it."""

    enabled: bool = Field(False, description="Train LoRA adapters instead of every weight.")
    stages: list[StageName] | None = Field(
        None, description="The stages trained with LoRA (default: every stage in `stages`); the others train fully."
    )

    def for_stage(self, stage: str) -> LoraSettings | None:
        """The adapter settings of ``stage``, or None when it trains every weight."""
        if not self.enabled or (self.stages is not None and stage not in self.stages):
            return None
        return LoraSettings(**self.model_dump(include=set(LoraSettings.model_fields)))


class ReferenceConfig(Section):
    batch_size: int = Field(128, ge=1, description="Pairs per reference forward pass.")


class SuiteDataset(Section):
    path: str = Field(
        description=f"A `datasets` builder that reads local files ({', '.join(LOCAL_BUILDERS)}) with `data_files`, "
        "or a local folder (a copy of the hub dataset's repository)."
    )
    data_files: dict[str, str] | None = Field(
        None, description="Split → local file, as the task's splits name them (e.g. `test`, `train` for few-shot)."
    )
    name: str | None = Field(None, description="The dataset's configuration (`dataset_name`); null: none.")


class SuiteTask(Section):
    task: str = Field(
        description=f"An lm-evaluation-harness task: a name of its registry (`gsm8k`, `arc_easy`, …), a task YAML "
        f"file (a path ending in .yaml), or `{BUILTIN_ADDITION}` (the built-in task's held-out prompts)."
    )
    dataset: SuiteDataset | None = Field(
        None, description="Read the task's documents from here instead of its config's `dataset_path` (offline data)."
    )
    num_fewshot: int | None = Field(None, ge=0, description="Few-shot examples; null: the task's own.")
    limit: int | None = Field(None, ge=1, description="Score the first documents only; null: all.")
    batch_size: int = Field(16, ge=1, description="Requests per forward / generate() call.")
    apply_chat_template: bool | None = Field(
        None,
        description="Render requests with the model's chat template; null: where the tokenizer has one, but for "
        f"`{BUILTIN_ADDITION}`, whose prompts the pipeline trains on as plain text.",
    )
    download: bool = Field(
        False,
        description="Let the harness download a hub dataset (a machine that reaches the hub); false: a task whose "
        "data is not local fails before any model is scored.",
    )

    @property
    def label(self) -> str | None:
        """The task's name, which prefixes its metrics (``<task>/<metric>/<filter>``); None where a
        task file gives none that can be read without the harness."""
        if self.task == BUILTIN_ADDITION:
            return "addition"
        if not self.task.endswith((".yaml", ".yml")):
            return self.task
        return yaml_task_name(Path(self.task))

    def request(self, index: int) -> SuiteRequest:
        data = (
            None if self.dataset is None else SuiteData(self.dataset.path, self.dataset.data_files, self.dataset.name)
        )
        return SuiteRequest(
            self.task,
            f"evaluation.suites[{index}]",
            data,
            self.num_fewshot,
            self.limit,
            self.batch_size,
            self.apply_chat_template,
            self.download,
        )


def yaml_task_name(path: Path) -> str | None:
    """The ``task:`` of a task YAML file, read without importing its ``!function`` tags."""

    class Tolerant(yaml.SafeLoader):
        pass

    Tolerant.add_multi_constructor("!", lambda loader, suffix, node: None)
    try:
        loaded = yaml.load(path.read_text(), Loader=Tolerant)  # noqa: S506 (a SafeLoader)
    except (OSError, yaml.YAMLError):
        return None
    return str(loaded["task"]) if isinstance(loaded, dict) and "task" in loaded else None


class EvaluationConfig(Section):
    num_prompts: int = Field(300, ge=1, description="Held-out prompts scored per model (at most the split's size).")
    num_samples: int = Field(4, ge=1, description="Samples per prompt at `temperature`: sampled accuracy is mean@N.")
    pass_k: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=lambda: [1, 4],
        description="k values for pass@k (unbiased estimator); k > num_samples is skipped.",
    )
    temperature: float = Field(1.0, gt=0, description="Temperature of the sampled completions.")
    max_new_tokens: int = Field(
        5,
        ge=1,
        description="Generated tokens per completion at most; with the longest prompt scored at most the model's "
        "context (checked once the data is prepared, before any stage trains, and before each model generates).",
    )
    batch_size: int = Field(256, ge=1, description="Prompts per generate() call.")
    bootstrap_resamples: int = Field(1000, ge=10, description="Bootstrap resamples for the 95% confidence intervals.")
    num_logged_samples: int = Field(
        20, ge=0, description="Rows of the samples table (prompt, completion, reward, correct) per model."
    )
    seed: Seed = Field(0, description="Seed of sampling and of the bootstrap; the same for every model.")
    generation_backend: Literal["hf", "vllm"] = Field(
        "hf",
        description="What generates the greedy and sampled completions: `hf`, the model's `generate`; `vllm`, a vLLM "
        "engine built from the first model scored and synced for the next ones (one per process; needs vLLM: "
        "`make install-vllm`, docs/evaluation.md).",
    )
    reward_model: str | None = Field(
        None,
        description="Score every model's sampled completions with this reward model, reported as "
        "`reward_model_score` (the mean, with its 95% CI) beside exact match: a reward stage of the experiment "
        "(e.g. `reward`) or a saved reward model's source (folder, `runs:/…`, `models:/…`, hub id). It must share "
        "the models' tokenizer. null: none.",
    )
    suites: list[SuiteTask] = Field(
        default_factory=list,
        description="lm-evaluation-harness tasks every model is scored on as well, by the harness itself; metrics "
        "`<task>/<metric>/<filter>` (docs/evaluation.md: Suites).",
    )

    def metric_problem(self, name: str) -> str | None:
        """Why ``name`` is no metric this evaluation produces; None where it is one: a built-in score
        or a metric of a task of :attr:`suites` (:meth:`names_suite_metric`)."""
        known = evaluation_metric_names(self.pass_k, self.num_samples, self.reward_model is not None)
        if name in known or self.names_suite_metric(name):
            return None
        return (
            f"{name!r} is not a metric the evaluation produces; known: {', '.join(known)}, "
            "or a metric of a task of evaluation.suites (`<task>/<metric>/<filter>`)"
        )

    def names_suite_metric(self, name: str) -> bool:
        """Whether ``name`` has the shape of a suite task's metric, ``<task>/<metric>/<filter>`` (which
        metrics a task reports, only the harness knows: a missing one fails the gate, naming those it has)."""
        parts = suite_metric_parts(name)
        return parts is not None and parts[0] in {suite.label for suite in self.suites}

    def resolved_suites(self, builtin: AdditionTaskConfig | None, folder: Path) -> tuple[HarnessTask, ...]:
        """:attr:`suites` ready to run (``trainers.evaluation.harness.resolve_suite``), their generated
        data in ``folder``: ``builtin:addition`` scores the first :attr:`num_prompts` held-out problems
        of ``builtin`` (``data.builtin``). Raises ``SuiteError`` naming a task whose data would be
        downloaded."""
        from trainers.data.synthetic import AdditionTask, generate_addition

        held_out = [] if builtin is None else generate_addition(AdditionTask(**builtin.model_dump()))["eval_prompts"]
        requests = [suite.request(index) for index, suite in enumerate(self.suites)]
        return tuple(resolve_suite(request, folder, held_out[: self.num_prompts]) for request in requests)

    def check_suites(self, data: DataConfig) -> None:
        """What the suites need of the rest of the config (their data is checked once prepared)."""
        for index, suite in enumerate(self.suites):
            if suite.task == BUILTIN_ADDITION and data.builtin is None:
                raise ValueError(
                    f"evaluation.suites[{index}]: {BUILTIN_ADDITION} scores the built-in task (data.builtin)"
                )
            if suite.label is None:
                raise ValueError(
                    f"evaluation.suites[{index}].task: {suite.task} is no readable task file with a `task:`"
                )

    def generation(self):
        """These settings as the trainers' evaluation takes them (imports torch)."""
        from trainers.evaluation.evaluate import GenerationSpec

        return GenerationSpec(
            self.max_new_tokens, self.num_samples, self.temperature, self.batch_size, self.seed, self.generation_backend
        )

    def spec(self, padding_free: PaddingFree, suites: tuple[HarnessTask, ...] = ()):
        """The whole evaluation of one model as the trainers take it (imports torch), its scoring
        passes padding-free as ``compute.padding_free`` says, scored on the resolved ``suites``
        (:func:`trainers.evaluation.harness.resolve_suite` of :attr:`suites`)."""
        from trainers.evaluation.evaluate import EvaluationSpec

        return EvaluationSpec(
            self.generation(),
            tuple(self.pass_k),
            self.bootstrap_resamples,
            self.num_logged_samples,
            self.batch_size,
            padding_free,
            suites,
        )


class PromotionConfig(Section):
    registered_model: str | None = Field(
        None,
        pattern=r"^[^/:@]+$",
        description="MLflow registered model to promote the final model into (no `/`, `:` or `@`: model URIs "
        "split on them); null turns the gate off.",
    )
    metric: str = Field(
        "sampled_accuracy",
        description="Evaluation metric the gate compares (`reward_model_score` with an `evaluation.reward_model`).",
    )
    min_improvement: float = Field(
        0.0, description="Required gain of `metric` over the current champion, re-scored on the same prompts."
    )
    min_value: float | None = Field(
        0.0,
        description="`metric` must exceed this for any promotion, the first included (a model that scores 0 never "
        "becomes the first champion); null: no floor.",
    )
    alias: str = Field(
        "champion",
        pattern=r"^[A-Za-z0-9_-]+$",
        description="Registry alias that marks the promoted version (not `latest` nor `v<digits>`: MLflow's).",
    )

    @field_validator("alias")
    @classmethod
    def _alias_mlflow_allows(cls, value: str) -> str:
        if value == "latest" or re.fullmatch(r"[vV]\d+", value):
            raise ValueError(f"{value!r} is reserved by MLflow's model registry (latest, v<version>)")
        return value

    confidence: float | None = Field(
        0.95,
        gt=0,
        lt=1,
        description="The gain must be significant: the one-sided lower bound of a paired bootstrap over the "
        "held-out prompts, at this confidence, above 0. null compares the means only.",
    )

    @property
    def model_name(self) -> str:
        """:attr:`registered_model`, which the gate (on only with one) promotes into."""
        if self.registered_model is None:
            raise ValueError("promotion.registered_model is null: the promotion gate is off")
        return self.registered_model


class TrackingConfig(Section):
    experiment_name: str = Field("alignflow", min_length=1, pattern=r"\S", description="MLflow experiment.")
    run_name: str | None = Field(None, description="Parent run name; defaults to the config name.")
    log_checkpoints: Literal["all", "final", "none"] = Field(
        "final",
        description="What each training stage stores in MLflow besides its metrics: the final model (`final`), also "
        "every saved checkpoint with its optimizer state (`all`: about 3x the model's size per checkpoint, e.g. 1.3 GB "
        "for 147 MB of final models on the tiny models), or no model (`none`; the final model stays in outputs/).",
    )
    keep_checkpoints: bool = Field(
        False,
        description="Keep a finished stage's intermediate checkpoints (weights and optimizer state) in outputs/; "
        "by default only its final model stays there (checkpoints serve to resume an unfinished stage).",
    )


PLUGINS = (
    "Modules imported before the rest of the config is validated; they may register losses, rewards, reward "
    "scales and reward heads (e.g. `my_project.losses`)."
)


def with_plugins_imported(data: Any) -> Any:
    """A before-validator's part: import the raw config's ``plugins`` first, so that the names they
    register validate."""
    if isinstance(data, dict):
        import_plugins(data.get("plugins") or [])
    return data


class ExperimentBase(Section):
    """An experiment's fields and sections but the stages' (:data:`ExperimentConfig` adds those)."""

    name: SafeName = Field(
        "default",
        description="Experiment name, used for the run name and the output folder: letters, digits, '.', '_', '-'.",
    )
    stages: list[StageName] = Field(
        default_factory=lambda: ["sft", "dpo", "grpo"],
        min_length=1,
        description="Training stages, in order; each starts from the previous stage's model.",
    )
    plugins: list[str] = Field(default_factory=list, description=PLUGINS)
    seed: Seed | None = Field(
        None,
        description="One seed for all randomness of a run: sets model.seed (built-in model init), each stage's "
        "seed (data order, dropout, GRPO sampling) and evaluation.seed (sampling, bootstrap); null leaves them.",
    )

    model: ModelConfig = Field(default_factory=ModelConfig)
    peft: PeftConfig = Field(default_factory=PeftConfig, title="PEFT (LoRA)")
    data: DataConfig = Field(default_factory=DataConfig)
    reference: ReferenceConfig = Field(default_factory=ReferenceConfig)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    compute: ComputeConfig = Field(default_factory=ComputeConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    promotion: PromotionConfig = Field(default_factory=PromotionConfig)

    @model_validator(mode="before")
    @classmethod
    def _apply_seed(cls, data: Any) -> Any:
        """``seed: s`` writes ``s`` into every field of :func:`seeded_fields`; one of them set
        explicitly to another value is an error (one source of truth per run). A seed that is no
        :data:`Seed` is written nowhere: its own field reports it, once."""
        if not isinstance(data, dict) or data.get("seed") is None:
            return data
        try:
            seed = SEED.validate_python(data["seed"])
        except ValidationError:
            return data
        tree = {k: v.model_dump(exclude_unset=True) if isinstance(v, BaseModel) else v for k, v in data.items()}
        for key in seeded_fields():
            current = get_path(tree, key)
            if current is not None and current != seed:
                raise ValueError(f"seed: {seed} sets {key}, which is also set to {current}; set only one of them")
            set_path(tree, key, seed)
        return tree

    @model_validator(mode="before")
    @classmethod
    def _import_plugins(cls, data: Any) -> Any:
        return with_plugins_imported(data)

    @model_validator(mode="after")
    def _check_promotion_has_a_model_to_register(self) -> ExperimentBase:
        if self.promotion.registered_model and self.tracking.log_checkpoints == "none":
            raise ValueError(
                "tracking.log_checkpoints: none stores no model in MLflow, which promotion.registered_model registers; "
                "use final or all"
            )
        return self

    @model_validator(mode="after")
    def _check_peft_stages(self) -> ExperimentBase:
        if not self.peft.enabled:
            return self
        unknown = sorted(set(self.peft.stages or []) - set(self.stages))
        if unknown:
            raise ValueError(f"peft.stages: {unknown} not among the stages {self.stages}")
        for stage in self.stages:
            if self.peft.for_stage(stage) and getattr(self.stage(stage), "sync_ref_model", False):
                raise ValueError(
                    f"{stage}.sync_ref_model mixes the policy into a separate reference model; with LoRA the "
                    f"reference is the policy with its adapters disabled: turn one of them off (or leave {stage} "
                    "out of peft.stages)"
                )
        return self

    @model_validator(mode="after")
    def _check_data_for_stages(self) -> ExperimentBase:
        if len(set(self.stages)) != len(self.stages):
            raise ValueError(f"stages must not repeat: {self.stages}")
        for stage in self.stages:
            splits = STAGES[stage].splits
            if self.data.builtin is None and all(getattr(self.data, split) is None for split in splits):
                needs = " or ".join(f"data.{split}" for split in splits)
                raise ValueError(f"stage {stage!r} needs {needs} (or data.builtin)")
        if (problem := self.evaluation.metric_problem(self.promotion.metric)) is not None:
            raise ValueError(f"promotion.metric: {problem}")
        scored = self.evaluation.reward_model is not None
        paired = per_prompt_metric_names(self.evaluation.pass_k, self.evaluation.num_samples, scored)
        if (
            self.promotion.registered_model
            and self.promotion.confidence is not None
            and self.promotion.metric not in paired
            and not self.evaluation.names_suite_metric(self.promotion.metric)
        ):
            raise ValueError(
                f"promotion.metric: {self.promotion.metric!r} has no per-prompt values for the paired test of "
                f"promotion.confidence; use one of {', '.join(paired)}, or set promotion.confidence: null"
            )
        return self

    @model_validator(mode="after")
    def _check_suites(self) -> ExperimentBase:
        self.evaluation.check_suites(self.data)
        return self

    @model_validator(mode="after")
    def _one_mixed_precision(self) -> ExperimentBase:
        if self.compute.mixed_precision == "no":
            return self
        doubled = [stage for stage in self.stages if self.stage(stage).bf16 is not False]
        if doubled:
            raise ValueError(
                f"compute.mixed_precision ({self.compute.mixed_precision}) applies to every stage; "
                f"{', '.join(f'{stage}.bf16' for stage in doubled)} sets it again: set one of them"
            )
        return self

    @model_validator(mode="after")
    def _check_stages_with_compute(self) -> ExperimentBase:
        for stage in self.stages:
            try:
                STAGES[stage].check(self.stage(stage), self.compute)
            except ValueError as error:
                raise ValueError(f"{stage}: {error}") from None
        return self

    @model_validator(mode="after")
    def _check_reward_models(self) -> ExperimentBase:
        """A stage's ``model:<stage>`` reward names a reward stage before it; the last stage trains the policy."""
        for index, stage in enumerate(self.stages):
            for target in STAGES[stage].reward_models(self.stage(stage)):
                if target not in STAGES:
                    continue  # a model path or hub id
                if STAGES[target].produces != "reward_model" or target not in self.stages[:index]:
                    raise ValueError(
                        f"{stage}.reward_funcs: model:{target} names a stage; it must be a reward stage listed before "
                        f"{stage} in stages {self.stages}"
                    )
        if STAGES[self.stages[-1]].produces != "policy":
            raise ValueError(
                f"stages: the last stage, {self.stages[-1]}, trains a reward model; end with a stage that trains "
                "the policy (e.g. grpo scored by model:reward)"
            )
        return self

    @model_validator(mode="after")
    def _check_evaluation_reward_model(self) -> ExperimentBase:
        name = self.evaluation.reward_model
        if name is None:
            return self
        if name in STAGES:
            if STAGES[name].produces != "reward_model" or name not in self.stages:
                raise ValueError(
                    f"evaluation.reward_model: {name} names a stage; it must be a reward stage among stages "
                    f"{self.stages}"
                )
            return self
        check_source_field(name, "evaluation.reward_model")
        return self

    @model_validator(mode="after")
    def _check_teachers(self) -> ExperimentBase:
        for stage in self.stages:
            teacher = STAGES[stage].teacher(self.stage(stage))
            if teacher is not None:
                check_source_field(teacher.path, f"{stage}.teacher_model")
        return self

    def stage(self, name: str) -> TrainingConfig:
        """The config section of stage ``name``."""
        return getattr(self, name)

    @property
    def run_name(self) -> str:
        return self.tracking.run_name or self.name


if TYPE_CHECKING:
    # The stages' sections are added at import time, so a type checker sees the base; they are read
    # through `ExperimentBase.stage(name)`.
    ExperimentConfig = ExperimentBase
else:
    # One section per registered stage, after the experiment's own (the form's order).
    ExperimentConfig = create_model(
        "ExperimentConfig",
        __base__=ExperimentBase,
        __module__=__name__,
        __doc__="An experiment: its name, stages and plugins, one section per concern, then one per stage.",
        **{
            spec.name: (
                spec.section,
                Field(default_factory=spec.section, title=spec.title, description=spec.description),
            )
            for spec in STAGES.values()
        },
    )


class EvaluationRequest(Section):
    """What the standalone evaluation flow scores: any models, on one eval spec, same prompts and seeds."""

    name: SafeName = Field("evaluation", description="Parent run name and output folder.")
    plugins: list[str] = Field(default_factory=list, description=PLUGINS)
    models: dict[SafeName, ModelSource] = Field(
        min_length=1,
        description=(
            "Label → model source: local folder, `runs:/<id>/model`, `models:/<name>@<alias>`, hub id or `builtin:…`."
        ),
    )
    reference_model: ModelSource | None = Field(
        None, description="Model source of the reference for held-out implicit-reward metrics."
    )
    beta: float = Field(0.5, gt=0, description="β of the implicit reward β·(π − ref).")
    reference: ReferenceConfig = Field(default_factory=ReferenceConfig)
    data: DataConfig = Field(
        default_factory=DataConfig, description="Where the eval prompts and held-out pairs come from."
    )
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    compute: ComputeConfig = Field(default_factory=ComputeConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    @property
    def run_name(self) -> str:
        return self.tracking.run_name or self.name

    @model_validator(mode="before")
    @classmethod
    def _import_plugins(cls, data: Any) -> Any:
        return with_plugins_imported(data)

    @model_validator(mode="after")
    def _check_suites(self) -> EvaluationRequest:
        self.evaluation.check_suites(self.data)
        return self

    @model_validator(mode="after")
    def _reward_model_is_a_source(self) -> EvaluationRequest:
        if self.evaluation.reward_model is not None:
            check_source_field(self.evaluation.reward_model, "evaluation.reward_model")
        return self


def seeded_fields() -> list[str]:
    """The fields a top-level ``seed`` sets: the built-in model's init, every stage's training seed
    and the evaluation's. Not ``data.builtin.seed`` nor ``data.seed``: they choose the task's
    problems and the data mixture, which a comparison over seeds keeps fixed."""
    return ["model.seed", *(f"{name}.seed" for name in STAGES), "evaluation.seed"]


SCHEMAS: dict[str, type[Section]] = {"ExperimentConfig": ExperimentConfig, "EvaluationRequest": EvaluationRequest}
