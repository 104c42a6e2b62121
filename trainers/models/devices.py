"""The dtypes and precision a trainer runs in: the compute section's values as torch and
``TrainingArguments`` take them. (The compute policy and its hardware checks are
``infra.core.config.compute``'s.) No torch at import."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from trainers.models.lora import ADAPTER_CONFIG

if TYPE_CHECKING:
    import torch


def torch_dtype(name: str) -> torch.dtype | str:
    """``auto`` (the checkpoint's own dtype, as transformers reads it) or the named torch dtype."""
    import torch

    return name if name == "auto" else getattr(torch, name)


def load_dtype(path: str, revision: str | None = None, dtype: str = "auto") -> str:
    """The dtype :func:`trainers.models.pretrained.load_causal_lm` loads ``path`` in, without loading its
    weights (and, for a local folder, without importing transformers): ``dtype``, or for ``auto``
    the one the checkpoint's config declares (``float32`` when it declares none; an adapter folder's
    base model's)."""
    if dtype != "auto":
        return dtype
    folder = Path(path)
    if (folder / ADAPTER_CONFIG).is_file():  # a LoRA adapter folder loads on its base model, in the base's dtype
        return load_dtype(json.loads((folder / ADAPTER_CONFIG).read_text())["base_model_name_or_path"], None, dtype)
    if (folder / "config.json").is_file():
        config = json.loads((folder / "config.json").read_text())
        declared = config.get("dtype") or config.get("torch_dtype")  # the key before transformers 5
    else:  # a hub id
        from transformers import AutoConfig

        declared = AutoConfig.from_pretrained(path, revision=revision).dtype
    return str(declared or "float32").removeprefix("torch.")


def model_dtype(model: torch.nn.Module) -> str:
    """The dtype the model's forward runs in, read from its floating-point parameters (``float32``, …)."""
    dtypes = {str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.is_floating_point()}
    if len(dtypes) != 1:
        raise ValueError(f"the model's parameters have several dtypes {sorted(dtypes)}")
    return dtypes.pop()


def mixed_precision_arguments(mixed_precision: str) -> dict[str, bool]:
    """``TrainingArguments`` of ``compute.mixed_precision`` (nothing for ``no``, so a stage's own ``bf16`` holds)."""
    return {} if mixed_precision == "no" else {mixed_precision: True}


# Config fields that count a mixture of experts' routed experts (Mixtral, Qwen-MoE, DeepSeek, OLMoE…).
EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def routes_to_experts(model_config) -> bool:
    """Whether the model routes each token to some of several experts: a step may then leave an
    expert's trainable weights without a gradient."""
    counts = (getattr(model_config, name, None) for name in EXPERT_COUNTS)
    return any(isinstance(count, int) and count > 1 for count in counts)


def ddp_arguments(model: torch.nn.Module) -> dict[str, bool]:
    """``TrainingArguments.ddp_find_unused_parameters`` from what the model needs. DDP's search for
    parameters without a gradient walks the autograd graph every step and warns on every rank when
    it finds none; the Trainer turns it on whenever gradient checkpointing is off (always, for a
    LoRA model). Only a mixture of experts needs it: a dense model uses every trainable parameter
    in every forward."""
    return {"ddp_find_unused_parameters": routes_to_experts(model.config)}


def placed_on(placement: str, policy_device: torch.device | str, field: str) -> torch.device:
    """The device of a frozen helper model (``trainers.sections.Placement``): the policy's for
    ``policy``, else the named one, which this machine must have."""
    import torch

    if placement == "policy":
        return torch.device(policy_device)
    device = torch.device(placement)
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"{field}: {placement}, but this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device
