"""The stage registry: one :class:`StageSpec` per training stage.

A spec holds everything the rest of alignflow needs to know about a stage: its config section
(which becomes a section of the experiment config and of the Prefect UI form), how to build its
trainer, the prepared data split it trains on, whether it trains on cached reference log-probs,
whether its result may be cached across flow runs, what its section must satisfy with the
compute section, and what it samples while it trains. The config, the train task and the flow
read specs; none of them names a stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Callable, Literal, Mapping, Sequence

from trainers.generation.budget import Generation
from trainers.models.lora import LoraSettings
from trainers.registry import RegisteredName, Registry
from trainers.sections import PaddingFree, StageCompute, TrainingConfig

if TYPE_CHECKING:
    from datasets import Dataset
    from transformers import Trainer


@dataclass(frozen=True)
class ModelSource:
    """A checkpoint folder or hub id, and the hub revision."""

    path: str
    revision: str | None = None


@dataclass(frozen=True)
class StageInputs:
    """What a stage's trainer is built from."""

    policy: ModelSource  # the model the stage starts from
    reference: ModelSource  # DPO's reference, GRPO's KL anchor: the same starting model
    splits: Mapping[str, Dataset]  # prepared splits; with ``ref_*`` columns when the stage reads reference log-probs
    output_dir: str
    # The compute section's values, without defaults: ``ComputeConfig`` declares those.
    dtype: str  # ``compute.dtype``: the dtype the models are loaded in
    mixed_precision: str  # ``compute.mixed_precision``: bf16 / fp16 autocast of the stage
    cpu: bool  # ``compute.cpu``: train on the CPU (several processes: gloo) even where there is a GPU
    padding_free: PaddingFree  # ``compute.padding_free``: the trainer's passes pack their rows without padding
    callbacks: list = field(default_factory=list)
    lora: LoraSettings | None = None  # train LoRA adapters on the frozen policy instead of all its weights
    reward_models: Mapping[str, ModelSource] = field(default_factory=dict)  # earlier reward stages' models, by stage
    teacher: ModelSource | None = None  # the frozen model a distillation stage learns from
    # ``data.chat_template``'s text over the policy tokenizer's own (the template the data was prepared with)
    chat_template: str | None = None

    def load_policy(self):
        """The policy and its tokenizer (with :attr:`chat_template`); with ``lora``, wrapped with fresh
        trainable adapters."""
        from trainers.models.lora import add_adapters
        from trainers.models.pretrained import load_causal_lm

        model, tokenizer = load_causal_lm(
            self.policy.path, self.policy.revision, self.dtype, chat_template=self.chat_template
        )
        return (model if self.lora is None else add_adapters(model, self.lora)), tokenizer

    def load_reference(self):
        """A frozen reference model in memory, or None with ``lora``: the policy with its adapters
        disabled is the reference then (:func:`trainers.models.lora.live_reference`), with no second copy."""
        from trainers.models.pretrained import load_causal_lm

        if self.lora is not None:
            return None
        return load_causal_lm(self.reference.path, self.reference.revision, self.dtype)[0]

    def trainer_arguments(
        self,
        section: TrainingConfig,
        arguments: type,
        model,
        tokenizer,
        train_split: str,
        eval_split: str | None = None,
        splits: Mapping[str, Any] | None = None,
        **overrides: Any,
    ) -> dict[str, Any]:
        """The keyword arguments every stage's ``Trainer`` takes: ``model``, its ``arguments``
        (a ``TrainingArguments`` class) from ``section`` and :meth:`runtime_arguments` (and
        ``overrides``), the train split, the eval split when prepared (evaluated then), the
        tokenizer and the callbacks. ``splits`` replaces the prepared splits (rows a stage builds)."""
        splits = self.splits if splits is None else splits
        evaluated = splits.get(eval_split) if eval_split is not None else None
        return dict(
            model=model,
            args=section.training_arguments(
                arguments, evaluates=evaluated is not None, **self.runtime_arguments(model), **overrides
            ),
            train_dataset=splits[train_split],
            eval_dataset=evaluated,
            processing_class=tokenizer,
            callbacks=self.callbacks,
        )

    def runtime_arguments(self, model) -> dict[str, Any]:
        """Trainer arguments that are not configuration: where to write, the pipeline's own logging,
        ``compute.mixed_precision`` (the Trainer puts the model on its device), what DDP needs
        of ``model`` (the one the trainer trains) and ``compute.padding_free`` (``PassArguments``)."""
        import torch

        from trainers.models.devices import ddp_arguments, mixed_precision_arguments

        return dict(
            output_dir=self.output_dir,
            save_total_limit=2,
            disable_tqdm=True,
            logging_nan_inf_filter=False,  # a non-finite loss is logged as it is (runtime.callbacks.FiniteGuard)
            dataloader_pin_memory=torch.cuda.is_available(),
            **mixed_precision_arguments(self.mixed_precision),
            **ddp_arguments(model),
            **({"use_cpu": True} if self.cpu else {}),
            padding_free=self.padding_free,
        )


@dataclass(frozen=True)
class GenerationServer:
    """A generation server that a stage's section asks the train task to start for the stage (GRPO's
    ``vllm_mode: server`` without a server's address): whether its weights travel through a folder
    of the stage's, the GPUs it runs on (None: those it finds), and the section as its trainer then
    gets it, from the server's address and that folder (None when it uses none)."""

    uses_folder: bool
    gpus: Sequence[int] | None
    served: Callable[[str, str | None], TrainingConfig]


def never(section: TrainingConfig) -> bool:
    return False


def no_check(section: TrainingConfig, compute: StageCompute) -> None:
    return None


@dataclass(frozen=True)
class StageSpec:
    name: str
    section: type[TrainingConfig]
    # The prepared splits it trains on (`data.<split>`, or the built-in task's): any one of them
    # suffices; its builder picks the first one present.
    splits: tuple[str, ...]
    build: Callable[[Any, StageInputs], Trainer]  # (section, inputs) -> a ready Trainer; imports torch lazily
    description: str
    # Whether the stage, so configured, trains on cached reference log-probs of its pairs (computed
    # from the model it starts from). Such a section has `beta`, the scale of its implicit rewards.
    needs_reference_logps: Callable[[Any], bool] = never
    # What its reference pass scores (a ``trainers.scoring.reference_views`` entry): the preference pairs,
    # or KTO's completions and KL completions; its trainer reads the view's splits, with their columns.
    reference_view: str = "pairs"
    # Whether its model is a pure function of its config, input model and data (then cached across runs).
    cacheable: bool = False
    # Raises ValueError when the section cannot run with the compute section (e.g. GRPO's batch
    # layout over the processes); the experiment config runs it for every enabled stage when it loads.
    check: Callable[[Any, StageCompute], None] = no_check
    # What its model is: the next stage's policy (a generating model, evaluated), or a reward model
    # (a sequence scorer that later stages' reward functions name; the policy passes it by).
    produces: Literal["policy", "reward_model"] = "policy"
    # The reward models its section names (``model:<stage or path>`` targets): those that are earlier
    # reward stages reach its trainer (``StageInputs.reward_models``) and its cache key.
    reward_models: Callable[[Any], tuple[str, ...]] = lambda section: ()
    # The frozen teacher its section names (a model source the flow resolves; ``StageInputs.teacher``).
    teacher: Callable[[Any], ModelSource | None] = lambda section: None
    # The completions it samples while it trains (GRPO's rollouts, on-policy distillation's): checked
    # against the model's context once the data is prepared, before any stage of the run trains.
    generation: Callable[[Any], Generation | None] = lambda section: None
    # The generation server it asks the train task to start for it, so configured (None: none).
    generation_server: Callable[[Any], GenerationServer | None] = lambda section: None
    # The key of its trainer's log that holds a table of sample completions (column -> values), which
    # the tracker logs as a table rather than as metrics (None: it logs none).
    completions_table: str | None = None
    # The training metrics that show how it learns, as its trainer logs them: what `alignflow compare`
    # plots of it unless told which (a GRPO loss near 0 says little; its mean reward says much).
    curves: tuple[str, ...] = ("loss", "grad_norm")

    @property
    def title(self) -> str:
        return self.name.upper()


STAGES: Registry[StageSpec] = Registry("stage", "stages")
StageName = Annotated[str, RegisteredName(STAGES)]


def stage_curves(stage: str) -> tuple[str, ...]:
    """The registered stage's :attr:`StageSpec.curves`; the default ones for a stage this process
    does not know (a plugin's, not imported here)."""
    return STAGES[stage].curves if stage in STAGES else StageSpec.curves


def register_stage(spec: StageSpec) -> StageSpec:
    STAGES.add(spec.name, spec)
    return spec
