"""``ExperimentConfig``: the one typed schema of an experiment.

It is loaded from YAML in ``configs/``, overridden from the command line as ``key.sub=value``,
and is the experiment flow's only parameter (the Prefect UI renders it as a form).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainers.losses import PREFERENCE_LOSSES, resolve_losses

from trainers.rewards import resolve_rewards  # the same checks as GRPOConfig's, at load time
from trainers.samplers import resolve_layout

Stage = Literal["sft", "dpo", "grpo"]


def section_title(name: str) -> str:
    return name.upper() if name in get_args(Stage) else name.replace("_", " ").capitalize()


def form_hints(schema: dict[str, Any], model: type[BaseModel]) -> None:
    """Prefect UI form hints. ``position`` keeps the fields in declaration order (the server stores
    schemas as JSONB, which reorders keys; the form sorts by ``position``); nested sections get a
    title (pydantic leaves ``$ref`` properties untitled, and the form would show the bare key)."""
    for position, (name, prop) in enumerate(schema.get("properties", {}).items()):
        prop["position"] = position
        prop.setdefault("title", section_title(name))


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=form_hints)

    def content_hash(self) -> str:
        return hashlib.sha256(json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[:16]

    def flat(self) -> dict[str, Any]:
        """``{"dpo.beta": 0.5, ...}``: the config as MLflow params."""
        return flatten(self.model_dump(mode="json"))


class ModelConfig(Section):
    source: str = Field("builtin:tiny-llama", description="`builtin:tiny-llama`, a Hugging Face model id or a local checkpoint path.")
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) for a model id.")
    seed: int = Field(0, description="Initialisation seed of a built-in model.")


class AdditionTaskConfig(Section):
    max_operand: int = Field(49, ge=1, description="Operands are drawn from 0..max_operand.")
    noise: float = Field(0.3, ge=0.0, lt=1.0, description="Fraction of SFT demonstrations with a wrong answer.")
    num_eval_problems: int = Field(300, ge=1, description="Held-out problems (eval prompts and eval pairs).")
    seed: int = Field(0, description="Seed of the problem split and of the noise.")


class DatasetSource(Section):
    path: str = Field(description="Local .json/.jsonl/.parquet/.csv file, or a `datasets.load_dataset` name.")
    name: str | None = Field(None, description="Dataset configuration name (hub datasets).")
    split: str = Field("train", description="Split to read (hub datasets).")
    revision: str | None = Field(None, description="Hub revision of the dataset.")


class DataConfig(Section):
    builtin: AdditionTaskConfig | None = Field(
        default_factory=AdditionTaskConfig, description="The built-in addition task; it fills every split not given below."
    )
    sft: DatasetSource | None = Field(None, description="`prompt`/`completion` rows for SFT.")
    preference: DatasetSource | None = Field(None, description="`prompt`/`chosen`/`rejected` rows for DPO.")
    preference_eval: DatasetSource | None = Field(None, description="Held-out preference pairs for reward accuracy.")
    eval_prompts: DatasetSource | None = Field(None, description="`prompt`/`answer` rows for accuracy.")
    grpo_prompts: DatasetSource | None = Field(
        None, description="`prompt` rows (and `answer`, passed to reward functions) for GRPO; held-out prompts must not be among them."
    )
    max_length: int = Field(32, ge=2, description="Maximum prompt + completion tokens.")
    max_prompt_length: int = Field(16, ge=1, description="Maximum prompt tokens.")
    truncation_mode: Literal["keep_end", "keep_start"] = Field(
        "keep_end", description="Which end of a too-long prompt to keep; completions keep their start."
    )


class TrainingConfig(Section):
    """Optimisation settings shared by every training stage."""

    num_train_epochs: float = Field(1.0, gt=0, description="Epochs over the stage's training split.")
    max_steps: int = Field(-1, description="If > 0, overrides num_train_epochs.")
    per_device_train_batch_size: int = Field(32, ge=1)
    gradient_accumulation_steps: int = Field(1, ge=1)
    learning_rate: float = Field(5e-4, gt=0)
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = "linear"
    warmup_ratio: float = Field(0.0, ge=0.0, lt=1.0, description="Fraction of steps used for linear warm-up.")
    weight_decay: float = Field(0.0, ge=0.0)
    max_grad_norm: float = Field(1.0, gt=0)
    logging_steps: int = Field(10, ge=1)
    save_steps: int = Field(0, ge=0, description="Save (and log to MLflow) a checkpoint every N steps; 0 = only at the end.")
    seed: int = 0


class SFTConfig(TrainingConfig):
    # Overridden defaults keep the base class's constraints.
    num_train_epochs: float = Field(50.0, gt=0, description="Epochs over the SFT demonstrations.")
    per_device_train_batch_size: int = Field(64, ge=1)
    learning_rate: float = Field(3e-3, gt=0)
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = "cosine"
    warmup_ratio: float = Field(0.05, ge=0.0, lt=1.0, description="Fraction of steps used for linear warm-up.")
    logging_steps: int = Field(50, ge=1)


LossName = Literal[tuple(PREFERENCE_LOSSES)]  # the registry's names, listed in the UI form


class DPOStageConfig(TrainingConfig):
    num_train_epochs: float = Field(3.0, gt=0, description="Epochs over the preference pairs.")
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = "constant"
    beta: float = Field(0.1, gt=0, description="β: scale of the log-ratios, e.g. −log σ(β·[(π_c − ref_c) − (π_r − ref_r)]) for sigmoid.")
    loss_type: LossName | list[LossName] = Field(
        "sigmoid", description="A registered preference loss (trainers/losses.py), or a list of them combined by loss_weights."
    )
    loss_weights: list[float] | None = Field(None, description="One weight per loss in loss_type (default: all 1).")
    label_smoothing: float = Field(
        0.0, ge=0.0, lt=0.5, description="ε: assumed label-flip rate, used by sigmoid (cDPO), robust and exo_pair."
    )
    discopop_tau: float = Field(0.05, gt=0, description="τ of the discopop loss.")
    reference: Literal["cached", "live", "none"] = Field(
        "cached",
        description="`cached`: precomputed reference log-prob columns; `live`: a frozen reference model in memory; "
        "`none`: reference-free (reference log-probs taken as 0).",
    )
    sync_ref_model: bool = Field(False, description="With `reference: live`, mix the policy into the reference every ref_model_sync_steps (TR-DPO).")
    ref_model_mixup_alpha: float = Field(0.6, gt=0.0, le=1.0, description="α in ref ← α·θ + (1 − α)·ref.")
    ref_model_sync_steps: int = Field(512, ge=1, description="Optimizer steps between reference syncs.")
    logging_steps: int = Field(20, ge=1)

    @model_validator(mode="after")
    def _check_losses_and_reference(self) -> DPOStageConfig:
        resolve_losses(self.loss_type, self.loss_weights, self.label_smoothing)
        if self.sync_ref_model and self.reference != "live":
            raise ValueError(f"sync_ref_model needs reference: live (got reference: {self.reference})")
        return self


class GRPOStageConfig(TrainingConfig):
    num_train_epochs: float = Field(3.0, gt=0, description="Epochs over the GRPO prompts (each prompt `num_generations` times per epoch).")
    per_device_train_batch_size: int = Field(128, ge=1, description="Completions per training step (prompts × `num_generations`).")
    learning_rate: float = Field(1.5e-4, gt=0)
    logging_steps: int = Field(20, ge=1)
    num_generations: int = Field(8, ge=2, description="Completions per prompt (G).")
    steps_per_generation: int | None = Field(
        None, ge=1, description="Training steps served by one generation batch; default: `gradient_accumulation_steps`."
    )
    generation_batch_size: int | None = Field(
        None, ge=2, description="Completions per generation batch (all processes); alternative to `steps_per_generation`."
    )
    num_iterations: int = Field(1, ge=1, description="Optimisation passes (μ) over each generation batch.")
    beta: float = Field(0.0, ge=0.0, description="KL coefficient to the starting policy; 0 loads no reference model.")
    epsilon: float = Field(0.2, ge=0.0, description="Clipping: ρ ≥ 1 − ε.")
    epsilon_high: float | None = Field(None, ge=0.0, description="Clipping: ρ ≤ 1 + ε_high; default: `epsilon`.")
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = Field("dapo", description="How token losses are averaged (trainers/grpo_losses.py).")
    scale_rewards: Literal["group", "batch", "none"] = Field("group", description="Advantage divisor: group std, batch std or none.")
    reward_funcs: list[str] = Field(
        default_factory=lambda: ["correctness"], min_length=1, description="Registered reward names or import paths `module:function`."
    )
    reward_weights: list[float] | None = Field(None, description="One weight per reward function; default: all 1.")
    mask_truncated_completions: bool = Field(False, description="Leave completions without EOS out of the loss.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k.")
    max_prompt_length: int | None = Field(None, ge=1, description="Keep the last N prompt tokens; default: as prepared (`data.max_prompt_length`).")
    max_completion_length: int = Field(6, ge=1, description="Generated tokens per completion at most.")
    log_completions_steps: int = Field(100, ge=0, description="Log a table of sample completions every N steps; 0 = never.")
    num_completions_to_log: int = Field(8, ge=1)

    @model_validator(mode="after")
    def _check_rewards_and_generation_layout(self) -> GRPOStageConfig:
        resolve_rewards(self.reward_funcs, self.reward_weights)
        resolve_layout(
            per_device_batch_size=self.per_device_train_batch_size,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            num_generations=self.num_generations,
            steps_per_generation=self.steps_per_generation,
            generation_batch_size=self.generation_batch_size,
        )
        return self


class ReferenceConfig(Section):
    batch_size: int = Field(128, ge=1, description="Pairs per reference forward pass.")


class EvaluationConfig(Section):
    num_prompts: int = Field(300, ge=1, description="Held-out prompts scored per model (at most the split's size).")
    num_samples: int = Field(4, ge=1, description="Samples per prompt at `temperature`: sampled accuracy is mean@N.")
    pass_k: list[int] = Field(default_factory=lambda: [1, 4], description="k values for pass@k (unbiased estimator); k > num_samples is skipped.")
    temperature: float = Field(1.0, gt=0)
    max_new_tokens: int = Field(5, ge=1)
    batch_size: int = Field(256, ge=1, description="Prompts per generate() call.")
    bootstrap_resamples: int = Field(1000, ge=10, description="Bootstrap resamples for the 95% confidence intervals.")
    num_logged_samples: int = Field(20, ge=0, description="Rows of the samples table (prompt, completion, reward, correct) per model.")
    seed: int = Field(0, description="Seed of sampling and of the bootstrap; the same for every model.")


class PromotionConfig(Section):
    registered_model: str | None = Field(
        None, description="MLflow registered model to promote the final model into; null turns the gate off."
    )
    metric: str = Field("sampled_accuracy", description="Evaluation metric the gate compares.")
    min_improvement: float = Field(0.0, description="Required gain of `metric` over the current champion, re-scored on the same prompts.")
    alias: str = Field("champion", description="Registry alias that marks the promoted version.")


class TrackingConfig(Section):
    experiment_name: str = Field("alignflow", description="MLflow experiment.")
    run_name: str | None = Field(None, description="Parent run name; defaults to the config name.")


class ExperimentConfig(Section):
    name: str = Field("default", description="Experiment name, used for the run name.")
    stages: list[Stage] = Field(
        default_factory=lambda: ["sft", "dpo", "grpo"], description="Training stages, in order; each starts from the previous stage's model."
    )
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    dpo: DPOStageConfig = Field(default_factory=DPOStageConfig)
    grpo: GRPOStageConfig = Field(default_factory=GRPOStageConfig)
    reference: ReferenceConfig = Field(default_factory=ReferenceConfig)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    promotion: PromotionConfig = Field(default_factory=PromotionConfig)

    @model_validator(mode="after")
    def _check_data_for_stages(self) -> ExperimentConfig:
        needed = {"sft": "sft", "dpo": "preference", "grpo": "grpo_prompts"}
        for stage in self.stages:
            split = needed[stage]
            if self.data.builtin is None and getattr(self.data, split) is None:
                raise ValueError(f"stage {stage!r} needs data.{split} (or data.builtin)")
        if len(set(self.stages)) != len(self.stages):
            raise ValueError(f"stages must not repeat: {self.stages}")
        return self

    @property
    def run_name(self) -> str:
        return self.tracking.run_name or self.name


class EvaluationRequest(Section):
    """What the standalone evaluation flow scores: any models, on one eval spec, same prompts and seeds."""

    name: str = Field("evaluation", description="Parent run name and output folder.")
    models: dict[str, str] = Field(
        min_length=1,
        description="Label → model source: local folder, `runs:/<id>/model`, `models:/<name>@<alias>`, hub id or `builtin:…`.",
    )
    reference_model: str | None = Field(None, description="Model source of the reference for held-out implicit-reward metrics.")
    beta: float = Field(0.5, gt=0, description="β of the implicit reward β·(π − ref).")
    reference: ReferenceConfig = Field(default_factory=ReferenceConfig)
    data: DataConfig = Field(default_factory=DataConfig, description="Where the eval prompts and held-out pairs come from.")
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    @property
    def run_name(self) -> str:
        return self.tracking.run_name or self.name


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def apply_override(tree: dict[str, Any], override: str) -> None:
    """Set ``a.b.c=value`` in a nested dict; the value is parsed as YAML (numbers, lists, null)."""
    key, sep, raw = override.partition("=")
    if not sep or not key:
        raise ValueError(f"override {override!r} is not of the form key.sub=value")
    *parents, leaf = key.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {override!r}: {part!r} is not a section")
    node[leaf] = yaml.safe_load(raw)


def load_config(path: str | Path | None = None, overrides: list[str] = (), schema: type[Section] | None = None) -> Section:
    """Validate YAML plus ``key.sub=value`` overrides against ``schema`` (default ExperimentConfig)."""
    tree: dict[str, Any] = {}
    if path is not None:
        tree = yaml.safe_load(Path(path).read_text()) or {}
    for override in overrides:
        apply_override(tree, override)
    return (schema or ExperimentConfig).model_validate(tree)


SCHEMAS: dict[str, type[Section]] = {"ExperimentConfig": ExperimentConfig, "EvaluationRequest": EvaluationRequest}
