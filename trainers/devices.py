"""The device and precision policy of the compute section, and the checks that need the hardware.

No torch at import: :func:`check_compute` runs where the flow starts, on the machine's facts
(:func:`detect_hardware`, read only when a setting needs them: the default CPU/float32 compute
section does not import torch), so a bad setting fails before anything is loaded or trained.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainers.lora import ADAPTER_CONFIG

if TYPE_CHECKING:
    import torch


class ComputeError(ValueError):
    """A compute setting this machine cannot run."""


@dataclass(frozen=True)
class Hardware:
    """What the compute checks need to know about a machine."""

    cuda_devices: int
    cuda_bf16: bool  # every CUDA device supports bfloat16


def detect_hardware() -> Hardware:
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return Hardware(cuda_devices=count, cuda_bf16=count > 0 and torch.cuda.is_bf16_supported())


def uses_gpu(compute: Any, hardware: Hardware) -> bool:
    """The GPU wherever there is one, unless ``compute.cpu``."""
    return hardware.cuda_devices > 0 and not compute.cpu


ONE_PROCESS_ONLY = (
    "compute.num_processes / num_machines: this flow runs in one process; only the experiment flow's "
    "training stages run over several (README: Scaling out)"
)


def check_compute(compute: Any, hardware: Hardware | None = None, *, launched: bool = False) -> None:
    """Raise :class:`ComputeError` naming the field when ``compute`` (a ``ComputeConfig``) cannot
    run here: more processes per machine than GPUs (without ``cpu``), several processes with
    neither GPUs nor ``cpu``, fp16 without a GPU, bfloat16 on a GPU without it. Several processes
    need a caller that ``launched`` them (the experiment flow's train task), on machine 0.
    ``hardware`` defaults to this machine's, detected only when a rule needs it."""
    facts = (lambda: hardware) if hardware is not None else functools.cache(detect_hardware)

    def gpu() -> bool:  # with compute.cpu, no hardware is read
        return not compute.cpu and uses_gpu(compute, facts())

    per_machine = compute.processes_per_machine
    if per_machine > 1 and not compute.cpu and per_machine > facts().cuda_devices:
        raise ComputeError(
            f"compute.num_processes: {per_machine} processes per machine, but this machine has "
            f"{facts().cuda_devices} CUDA device(s); set compute.cpu: true for CPU processes (gloo)"
        )
    if compute.mixed_precision == "fp16" and not gpu():
        raise ComputeError("compute.mixed_precision: fp16 needs a CUDA device (use bf16 on the CPU, or no)")
    wants_bf16 = "bf16" in (compute.mixed_precision, compute.dtype.replace("bfloat16", "bf16"))
    if wants_bf16 and gpu() and not facts().cuda_bf16:
        field = "mixed_precision" if compute.mixed_precision == "bf16" else "dtype"
        raise ComputeError(
            f"compute.{field}: this machine's CUDA device does not support bfloat16; use fp16 mixed precision "
            "and dtype float32"
        )
    if compute.multi_process and not launched:
        raise ComputeError(ONE_PROCESS_ONLY)
    if compute.machine_rank != 0:
        raise ComputeError(
            "compute.machine_rank: the flow runs on machine 0 and launches its part of each stage; the other "
            "machines run the launch command its train task logs (README: Scaling out)"
        )


def compute_device(compute: Any | None = None) -> torch.device:
    """The device of an in-process model (reference pass, evaluation): this process's GPU where
    there is one (``LOCAL_RANK`` under a launcher), unless ``compute.cpu``; else the CPU."""
    import os

    import torch

    if (compute is not None and compute.cpu) or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def torch_dtype(name: str) -> torch.dtype | str:
    """``auto`` (the checkpoint's own dtype, as transformers reads it) or the named torch dtype."""
    import torch

    return name if name == "auto" else getattr(torch, name)


def load_dtype(path: str, revision: str | None = None, dtype: str = "auto") -> str:
    """The dtype :func:`trainers.modeling.load_causal_lm` loads ``path`` in, without loading its
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
