"""Config sections: the one schema of each training stage, and the one mapping to ``TrainingArguments``.

A stage's pydantic section (:class:`TrainingConfig` plus the stage's own fields) is the only place
its fields, defaults and checks are written. The trainer's ``TrainingArguments`` subclass takes its
own fields from the section (:func:`section_fields`), and :meth:`TrainingConfig.training_arguments`
turns a section into those arguments. No torch here: the experiment config imports this.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import TYPE_CHECKING, Annotated, Any, Callable, Literal, Protocol, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

if TYPE_CHECKING:
    from transformers import TrainingArguments

Arguments = TypeVar("Arguments", bound="TrainingArguments")


def form_hints(schema: dict[str, Any], model: type[BaseModel]) -> None:
    """Prefect UI form hints. ``position`` keeps the fields in declaration order (the server stores
    schemas as JSONB, which reorders keys; the form sorts by ``position``); nested sections get a
    title (pydantic leaves ``$ref`` properties untitled, and the form would show the bare key)."""
    for position, (name, prop) in enumerate(schema.get("properties", {}).items()):
        prop["position"] = position
        prop.setdefault("title", name.replace("_", " ").capitalize())


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


class StageCompute(Protocol):
    """What a stage's load-time check may read of the compute section (``ComputeConfig``, which
    trainers do not import)."""

    @property
    def num_processes(self) -> int: ...

    @property
    def num_machines(self) -> int: ...


# Whether the passes over whole sequences run padding-free (``compute.padding_free``): ``auto`` where
# the model's attention keeps packed rows apart, ``true`` required there, ``false`` padded batches.
# ``trainers.models.attention.packing_for`` resolves it for a model.
PaddingFree = Union[bool, Literal["auto"]]

# Where a frozen helper model of a stage (a reward model, a teacher) runs: on the policy's device, or
# on one of its own (the CPU, or a GPU that training does not use). ``trainers.models.devices.placed_on``.
Placement = Annotated[str, Field(pattern=r"^(policy|cpu|cuda(:[0-9]+)?)$")]


def check_placement(field: str, placement: str, compute: StageCompute) -> None:
    """A GPU of its own serves one training process: every process would load the model on it."""
    if placement.startswith("cuda") and compute.num_processes > 1:
        raise ValueError(
            f"{field}: {placement} with compute.num_processes {compute.num_processes}: every process would load "
            "its own copy on that GPU; use policy (each process's device) or cpu"
        )


class Section(BaseModel):
    # inf and nan are refused in every float field of every config section (a diverging run is not a setting)
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, json_schema_extra=form_hints)

    def content_hash(self) -> str:
        return hashlib.sha256(json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[:16]

    def flat(self) -> dict[str, Any]:
        """``{"dpo.beta": 0.5, ...}``: the config as MLflow params."""
        return flatten(self.model_dump(mode="json"))


# What numpy, torch and Python's random all accept as a seed.
Seed = Annotated[int, Field(ge=0, le=2**32 - 1)]
SchedulerName = Literal["linear", "cosine", "constant", "constant_with_warmup"]
EvalStrategy = Literal["no", "steps", "epoch"]


def bare_no(value: Any) -> Any:
    """YAML reads a bare ``no`` as false: ``eval_strategy: no`` means ``"no"`` (a before-validator)."""
    return "no" if value is False else value


class TrainingConfig(Section):
    """Optimisation settings shared by every training stage. A stage overrides a default with
    ``Field(new default, <the same constraints>)``; ``tests/test_config.py`` checks they are kept."""

    num_train_epochs: float = Field(1.0, gt=0, description="Epochs over the stage's training split.")
    max_steps: int = Field(-1, description="If > 0, overrides num_train_epochs.")
    per_device_train_batch_size: int = Field(32, ge=1)
    gradient_accumulation_steps: int = Field(1, ge=1)
    learning_rate: float = Field(5e-4, gt=0)
    lr_scheduler_type: SchedulerName = "linear"
    warmup_ratio: float = Field(0.0, ge=0.0, lt=1.0, description="Fraction of steps used for linear warm-up.")
    weight_decay: float = Field(0.0, ge=0.0)
    max_grad_norm: float = Field(1.0, gt=0)
    logging_steps: int = Field(10, ge=1)
    save_steps: int = Field(
        0, ge=0, description="Save (and log to MLflow) a checkpoint every N steps; 0 = only at the end."
    )
    seed: Seed = 0
    eval_strategy: EvalStrategy = Field(
        "epoch",
        description="When to evaluate on the stage's held-out split (`data.sft_eval`, `data.preference_eval`): "
        "every `epoch`, every `eval_steps` (`steps`) or `no`; a stage without a held-out split never evaluates.",
    )
    eval_steps: int | None = Field(
        None,
        ge=1,
        description="Optimizer steps between evaluations with eval_strategy: steps (default: logging_steps).",
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in the backward pass (non-reentrant): less memory, ~30% more compute."
    )
    bf16: bool | Literal["auto"] = Field(
        False, description="bfloat16 mixed precision; `auto`: on where a CUDA device supports bfloat16."
    )
    report_to: list[str] = Field(
        default_factory=list,
        description="More Trainer integrations (`tensorboard`, `wandb`, …); MLflow is always on through the pipeline.",
    )

    _yaml_no = field_validator("eval_strategy", mode="before")(bare_no)

    @field_validator("report_to")
    @classmethod
    def _mlflow_is_the_pipelines(cls, report_to: list[str]) -> list[str]:
        doubled = sorted({"mlflow", "all"} & set(report_to))
        if doubled:
            raise ValueError(
                f"report_to: {doubled} would start transformers' own MLflow logging in a second run; MLflow is "
                "always on through the pipeline's callback: list only other integrations"
            )
        return report_to

    def training_arguments(
        self, arguments_class: type[Arguments], evaluates: bool = False, **runtime: Any
    ) -> Arguments:
        """The one mapping from a section to its trainer's arguments: every field by name (the
        class has them: ``TrainingArguments``' own, or added by :func:`section_fields`), except
        ``warmup_ratio`` (``warmup_steps`` below 1 is a fraction of the steps), ``save_steps`` (0
        turns step saving off), ``gradient_checkpointing`` (``activation_checkpointing``, its
        name since transformers 5.2x), ``bf16: auto`` (resolved for this machine) and ``eval_strategy``, which
        applies when the trainer ``evaluates`` (has a held-out split) and is ``no`` otherwise.
        ``bf16: true`` (or ``compute.mixed_precision: bf16``) on a machine without a GPU is CPU
        autocast. ``runtime`` holds what is not a stage's configuration (``output_dir``, the
        compute section's mixed precision and ``use_cpu``, …)."""
        values = self.model_dump()
        values["warmup_steps"] = values.pop("warmup_ratio")
        values["save_strategy"] = "steps" if self.save_steps else "no"
        values["per_device_eval_batch_size"] = self.per_device_train_batch_size
        values[checkpointing_argument(arguments_class)] = values.pop("gradient_checkpointing")
        values["bf16"] = bf16_available() if self.bf16 == "auto" else self.bf16
        if not evaluates:
            values["eval_strategy"] = "no"
        values |= runtime  # may hold compute's mixed precision (bf16 / fp16) and use_cpu
        if values["bf16"] and not accelerator_available():
            values["use_cpu"] = True  # bf16 autocast on the CPU; transformers refuses it otherwise
        return arguments_class(**values)


def checkpointing_argument(arguments_class: type) -> str:
    """``activation_checkpointing``, the argument's name in current transformers, or
    ``gradient_checkpointing`` in the releases before it (vLLM pins one: ``make install-vllm``)."""
    names = {field.name for field in dataclasses.fields(arguments_class)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


def bf16_available() -> bool:
    """Whether this machine trains in bfloat16: a CUDA device that supports it."""
    import torch

    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def accelerator_available() -> bool:
    import torch

    return torch.cuda.is_available() or torch.backends.mps.is_available()


def section_fields(section: type[TrainingConfig]) -> Callable[[type[Arguments]], type[Arguments]]:
    """Class decorator, applied before ``@dataclass``: give a ``TrainingArguments`` subclass the
    section's own fields (those ``TrainingConfig`` does not have), with the section's defaults, so
    a script that builds the arguments directly gets the same defaults as the pipeline."""

    def decorator(cls: type[Arguments]) -> type[Arguments]:
        inherited = {field.name for field in dataclasses.fields(cls)}
        annotations = cls.__dict__.get("__annotations__", {})
        for name, info in section.model_fields.items():
            if name in TrainingConfig.model_fields:
                continue
            if name in inherited:
                raise TypeError(f"{section.__name__}.{name} shadows a field of {cls.__name__}'s bases")
            annotations[name] = info.annotation
            default = {"default_factory": info.default_factory} if info.default_factory else {"default": info.default}
            setattr(cls, name, dataclasses.field(**default, metadata={"help": info.description}))
        cls.__annotations__ = annotations
        return cls

    return decorator
