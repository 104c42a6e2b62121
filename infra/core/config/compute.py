"""The compute section: where and in what precision every stage runs, the checks of it that need
the hardware, and the ``accelerate launch`` command it stands for.

No torch at import: the hardware is read (:func:`detect_hardware`) only when a check needs it.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field, field_validator, model_validator

from trainers.sections import PaddingFree, Section, bare_no

if TYPE_CHECKING:
    import torch

ACCELERATE_CONFIG_DIR = Path(__file__).parents[1] / "accelerate"
MixedPrecision = Literal["no", "bf16", "fp16"]
LoadDtype = Literal["auto", "float32", "bfloat16"]


def accelerate_config_path(name: str) -> Path:
    """A shipped accelerate config (``ddp``, ``fsdp``, ``zero2``, ``zero3``: ``infra/core/accelerate/<name>.yaml``)
    or the path of one's own file."""
    shipped = ACCELERATE_CONFIG_DIR / f"{name}.yaml"
    if shipped.is_file():
        return shipped
    path = Path(name).expanduser()
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in ACCELERATE_CONFIG_DIR.glob("*.yaml")))
        raise ValueError(f"accelerate_config: {name!r} is neither a shipped config ({known}) nor an existing file")
    return path


class ComputeConfig(Section):
    """Where and in what precision the stages, the reference pass and the evaluation run: one
    policy for all of them. The defaults are today's single process: the GPU where there is one,
    else the CPU, in the checkpoint's own dtype. Checks that need the hardware (device count,
    bfloat16 support) run when the flow starts (:func:`check_compute`)."""

    cpu: bool = Field(
        False, description="Run on the CPU even where a GPU is present (accelerate's --cpu; processes talk over gloo)."
    )
    num_processes: int = Field(1, ge=1, description="Processes in all (over every machine); one per GPU.")
    num_machines: int = Field(1, ge=1, description="Machines taking part in a multi-process stage.")
    machine_rank: int = Field(0, ge=0, description="This machine's rank (0 on the machine with main_process_ip).")
    main_process_ip: str | None = Field(None, description="Address of machine 0; needed when num_machines > 1.")
    main_process_port: int = Field(29500, ge=1, le=65535, description="Port of the rendezvous on machine 0.")
    machine_scheduler: str | None = Field(
        None,
        description="A Dask scheduler (`tcp://host:8786`) whose workers start machines 1…N−1's part of every launch: "
        "machine M's worker offers the resource `alignflow-machine-M` (`dask worker tcp://host:8786 --nthreads 1 "
        "--resources alignflow-machine-1=1`). Null: each other machine's part is started by hand (the logged command).",
    )
    join_timeout: int = Field(
        300,
        ge=1,
        description="Seconds every machine's part of a multi-machine launch waits for the others to join; then the "
        "launch fails on every machine, naming the machines that did not join.",
    )
    mixed_precision: MixedPrecision = Field(
        "no", description="Autocast of every training stage: `bf16`, `fp16` (CUDA only) or `no`."
    )
    dtype: LoadDtype = Field(
        "auto",
        description="dtype the models are loaded in (training, reference pass, evaluation); `auto`: the checkpoint's. "
        "`bfloat16` with `mixed_precision: no` trains pure bf16 weights (AdamW's small updates round away); "
        "for mixed precision load float32 and set `mixed_precision: bf16`.",
    )
    padding_free: PaddingFree = Field(
        "auto",
        description="Padding-free batches for every pass over whole sequences (training, the reference pass, "
        "evaluation's scoring): rows packed without padding, positions restarting per row, kept apart by the "
        "attention implementation. `auto`: wherever the model's attention supports it (sdpa, eager, flash "
        "attention); `true`: an error where it does not; `false`: padded batches. docs/padding-free.md.",
    )
    accelerate_config: str | None = Field(
        None,
        description="Accelerate config for FSDP or DeepSpeed: a shipped one (`ddp`, `fsdp`, `zero2`, `zero3`, "
        "infra/core/accelerate/) or a file.",
    )

    _yaml_no = field_validator("mixed_precision", mode="before")(bare_no)

    @field_validator("accelerate_config")
    @classmethod
    def _known_accelerate_config(cls, name: str | None) -> str | None:
        if name is not None:
            accelerate_config_path(name)
        return name

    @model_validator(mode="after")
    def _check_machines(self) -> ComputeConfig:
        if self.machine_rank >= self.num_machines:
            raise ValueError(f"machine_rank ({self.machine_rank}) must be below num_machines ({self.num_machines})")
        if self.num_machines > 1 and not self.main_process_ip:
            raise ValueError("num_machines > 1 needs main_process_ip (the address of machine 0)")
        if self.num_processes % self.num_machines:
            raise ValueError(
                f"num_processes ({self.num_processes}) must be a multiple of num_machines ({self.num_machines}): "
                "the same number of processes on every machine"
            )
        return self

    @property
    def trains_pure_bf16(self) -> bool:
        """Weights loaded in bfloat16 with no autocast: the optimizer updates the bf16 weights themselves."""
        return self.dtype == "bfloat16" and self.mixed_precision == "no"

    @property
    def processes_per_machine(self) -> int:
        return self.num_processes // self.num_machines

    @property
    def multi_process(self) -> bool:
        return self.num_processes > 1 or self.num_machines > 1

    def launch_command(self, spec_path: str | Path, module: str) -> list[str]:
        """The ``accelerate launch`` command of these settings running ``python -m module spec_path``.

        Several processes are launched as ``--multi_gpu`` even on the CPU: ``--cpu`` with
        ``--num_processes 2`` starts one process (accelerate 1.15); the stage itself asks for the
        CPU (``use_cpu``) and its processes talk over gloo. An ``accelerate_config`` file (FSDP,
        DeepSpeed) sets the distributed type; this section's counts override its own."""
        command = [sys.executable, "-m", "accelerate.commands.launch"]
        if self.accelerate_config:
            command += ["--config_file", str(accelerate_config_path(self.accelerate_config))]
        elif self.multi_process:
            command += ["--multi_gpu"]
        options = {
            "num_processes": self.num_processes,
            "num_machines": self.num_machines,
            "machine_rank": self.machine_rank,
            "main_process_port": self.main_process_port,
            "mixed_precision": self.mixed_precision,
            "dynamo_backend": "no",
            "main_process_ip": self.main_process_ip,
            # torch's rendezvous waits as long as the machines' join (600 s by default, silently)
            "rdzv_conf": f"timeout={self.join_timeout}" if self.num_machines > 1 else None,
        }
        for name, value in options.items():
            if value is not None:
                command += [f"--{name}", str(value)]
        return command + ["-m", module, str(spec_path)]


def launcher_temp_folder(folder: Path) -> dict[str, str]:
    """The environment an ``accelerate launch`` gets its temp folder from, ``folder`` (created):
    torch's launcher keeps a log folder per launch (``torchelastic_*``) in the temp folder and never
    removes it, so each launch gets one of its own, which its caller removes with the launch's files."""
    folder.mkdir(parents=True, exist_ok=True)
    return {"TMPDIR": str(folder)}


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


def uses_gpu(compute: ComputeConfig, hardware: Hardware) -> bool:
    """The GPU wherever there is one, unless ``compute.cpu``."""
    return hardware.cuda_devices > 0 and not compute.cpu


def check_compute(compute: ComputeConfig, hardware: Hardware | None = None) -> None:
    """Raise :class:`ComputeError` naming the field when ``compute`` cannot run here: more processes
    per machine than GPUs (without ``cpu``), several processes with neither GPUs nor ``cpu``, fp16
    without a GPU, bfloat16 on a GPU without it; a flow started anywhere but machine 0 (it launches
    every multi-process stage, reference pass and evaluation from there). ``hardware`` defaults to
    this machine's, detected only when a rule needs it."""
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
    if compute.machine_rank != 0:
        raise ComputeError(
            "compute.machine_rank: the flow runs on machine 0 and launches its part of each stage; the other "
            "machines run the launch command its train task logs (README: Scaling out)"
        )


def compute_device(cpu: bool) -> torch.device:
    """The device of an in-process model (reference pass, evaluation): this process's GPU where
    there is one (``LOCAL_RANK`` under a launcher), unless ``cpu`` (``compute.cpu``); else the CPU."""
    import torch

    if cpu or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
