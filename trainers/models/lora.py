"""LoRA adapters (the ``peft`` library): the settings, wrapping a policy, the adapter-disabled
reference, and saving a trained stage as its adapter plus a merged copy.

A LoRA policy is ``W + (α/r)·B·A`` on each target linear layer, ``W`` frozen, ``A``
(``r × in``, random) and ``B`` (``out × r``, zero) trained: a layer of shape ``out × in``
trains ``r·(in + out)`` parameters. With the adapters disabled the policy *is* its starting
model, which is why it serves as DPO's live reference and GRPO's KL anchor without a second copy.

The settings are pydantic only (the experiment config imports them); the functions import torch
and peft when they run.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Literal, Protocol, cast

from pydantic import Field

from trainers.sections import Section

if TYPE_CHECKING:
    import torch
    from peft import PeftModel
    from transformers import PreTrainedModel, Trainer
    from typing_extensions import TypeIs

ADAPTER_CONFIG = "adapter_config.json"


class LoraSettings(Section):
    r: int = Field(16, ge=1, description="Rank of each adapter (B·A).")
    alpha: float = Field(32.0, gt=0, description="Scale α: the update is (α/r)·B·A.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter's input.")
    target_modules: Literal["all-linear"] | list[str] = Field(
        "all-linear",
        description="`all-linear` (every linear layer but the output head) or module names, e.g. `[q_proj, v_proj]`.",
    )


class DeltaWeight(Protocol):
    """What every kind of LoRA layer (``Linear``, ``Embedding``, convolutions, …) defines, and their
    common base ``LoraLayer`` does not declare: an adapter's update of the base layer's weight."""

    def get_delta_weight(self, adapter: str) -> torch.Tensor: ...


def add_adapters(model: PreTrainedModel, settings: LoraSettings, task_type: str = "CAUSAL_LM") -> PeftModel:
    """``model`` frozen, with fresh LoRA adapters on ``settings.target_modules`` (the only
    trainable parameters, with, for a ``SEQ_CLS`` model, its whole score head: peft saves and
    trains the classifier head of that task type in full)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,  # type: ignore[arg-type]  # peft annotates an int; it scales by alpha / r
        lora_dropout=settings.dropout,
        target_modules=settings.target_modules,
        task_type=task_type,
    )
    return get_peft_model(model, config)


def has_adapters(model: torch.nn.Module) -> TypeIs[PeftModel]:
    from peft import PeftModel

    return isinstance(model, PeftModel)


@contextmanager
def live_reference(ref_model: torch.nn.Module | None, policy: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The model that computes live reference log-probs: ``ref_model``, or else the LoRA
    ``policy`` (the trainer's unwrapped ``model``) with its adapters disabled, in eval mode for
    the duration (its training mode is restored after)."""
    if ref_model is not None:
        yield ref_model
        return
    if not has_adapters(policy):
        raise ValueError("a live reference needs a ref_model, or a LoRA policy whose adapters can be disabled")
    was_training = policy.training
    policy.eval()
    try:
        with policy.disable_adapter():
            yield policy
    finally:
        policy.train(was_training)


def carries_adapters(model: torch.nn.Module) -> bool:
    """Whether ``model`` computes with LoRA adapters: a peft ``PeftModel`` (a LoRA stage's policy), or a
    transformers model an adapter folder was loaded into (``from_pretrained(adapter_folder)``: the
    adapters are layers of the model itself)."""
    from peft.tuners.lora import LoraLayer

    return has_adapters(model) or any(isinstance(module, LoraLayer) for module in model.modules())


def merged_weights(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The LoRA ``policy``'s weights (:func:`carries_adapters`) as a plain checkpoint of its base
    architecture names them: each adapted layer's ``W + (α/r)·B·A`` for its active adapter (computed
    out of place: merging in place and unmerging after would leave rounding error in the frozen ``W``
    at every call), every other parameter as it is; no adapter parameters. What an inference engine
    that serves the base architecture loads."""
    import torch
    from peft.tuners.lora import LoraLayer

    base = policy.get_base_model() if has_adapters(policy) else policy
    weights = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            weight = module.get_base_layer().weight
            assert isinstance(weight, torch.Tensor)
            (adapter,) = module.active_adapters
            delta = cast("DeltaWeight", module).get_delta_weight(adapter)
            weights[f"{name}.weight"] = weight.detach() + delta.detach().to(weight.dtype)
    for name, param in base.named_parameters():
        plain = name.replace(".base_layer.", ".")
        if "lora_" not in name and plain not in weights:
            weights[plain] = param.detach()
    return weights


def trainable_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def save_stage_model(trainer: Trainer, model_dir: Path, adapter_dir: Path) -> Path | None:
    """Save a trained stage. Full fine-tuning: the model in ``model_dir``; returns None. LoRA: the
    adapter (``adapter_config.json``, ``adapter_model.safetensors``, and the tokenizer, so
    ``from_pretrained(adapter_dir)`` loads base + adapter) in ``adapter_dir``, then a merged copy
    (``W + (α/r)·B·A``, a plain checkpoint) in ``model_dir``; returns ``adapter_dir``. The merge
    is done in place on the trainer's model, so this is the last thing a stage does with it."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    if not has_adapters(model):
        trainer.save_model(str(model_dir))
        return None
    trainer.save_model(str(adapter_dir))  # the adapter, and the tokenizer (processing_class)
    merged = model.merge_and_unload()
    if trainer.args.should_save:  # the main process, as for save_model
        merged.save_pretrained(str(model_dir))
        if trainer.processing_class is None:
            raise ValueError("a LoRA stage saves its tokenizer with its merged model; the trainer has no tokenizer")
        trainer.processing_class.save_pretrained(str(model_dir))
    return adapter_dir


def is_adapter_folder(path: Path) -> bool:
    return (path / ADAPTER_CONFIG).is_file()
