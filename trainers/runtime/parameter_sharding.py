"""Full parameters of a prepared model whose parameters may be sharded over the processes (FSDP,
DeepSpeed ZeRO-3): for generation and other forwards outside the training step, and for copying
them into a reference (TR-DPO's sync).

One :class:`ParameterSharding` per way accelerate lays a prepared model's parameters out,
chosen from accelerate's distributed type by :func:`sharding_of`:

* ``replicated``: one process, DDP, DeepSpeed ZeRO-1/2: every process holds every parameter.
* ``fsdp2``: ``fully_shard`` (``fsdp_version: 2``, infra/core/accelerate/fsdp.yaml).
* ``fsdp1``: ``FullyShardedDataParallel``.
* ``zero3``: DeepSpeed ZeRO-3.

A forward of a sharded model gathers each module's parameters as it runs it and shards them
again after it, through the library's own hooks, even inside a full gather (DeepSpeed releases
a module's parameters after its forward; FSDP2 reshards after forward per module). Gathering once
for a whole generation would mean removing DeepSpeed's hooks or changing FSDP2's reshard setting
without a way to read it back, so a forward instead runs in *lockstep*: every process runs the
same forwards (``generate(synced_gpus=True)`` goes on until every process is done). A full gather
(:attr:`ParameterSharding.full_parameters`) is for reading parameters only, with no forward inside.

The reference model is never sharded (:func:`prepare_reference`): a whole frozen copy on every
process's device, as ``accelerator.prepare_model(evaluation_mode=True)`` leaves it, so its forward
runs on local weights and the sync mixes the gathered policy into it on every process alike.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, TypeVar

import torch
from transformers.modeling_utils import unwrap_model

from trainers.registry import Registry

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)


@dataclass(frozen=True)
class ParameterSharding:
    name: str
    # Every parameter whole on every process for the duration, by its name in the unwrapped model
    # (read them, run no forward inside).
    full_parameters: Callable[[torch.nn.Module], ContextManager[dict[str, torch.Tensor]]]
    # What the unwrapped model needs to run a forward outside the prepared model's own.
    forward_ready: Callable[[torch.nn.Module], ContextManager]
    # Whether a forward gathers parameters (collectives): then every process runs the same forwards.
    lockstep: bool


SHARDINGS: Registry[ParameterSharding] = Registry("parameter sharding", "parameter sharding")


def no_gather(model: torch.nn.Module) -> ContextManager:
    return nullcontext()


@contextmanager
def local_parameters(model: torch.nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    yield dict(unwrap_model(model).named_parameters())


@contextmanager
def fsdp2_unsharded(model: torch.nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """Every ``fully_shard`` unit of ``model`` all-gathered (its parameters plain tensors), then resharded."""
    from torch.distributed.fsdp import FSDPModule

    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    for unit in units:
        unit.unshard()
    try:
        yield dict(model.named_parameters())
    finally:
        for unit in units:
            unit.reshard()


@contextmanager
def fsdp1_summoned(model: torch.nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """All of the wrapped ``model``'s parameters, by their names without FSDP's wrapper prefixes."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    with FullyShardedDataParallel.summon_full_params(model, writeback=False, recurse=True):
        yield dict(model.named_parameters())  # FSDP's own named_parameters drops its prefixes here


def fsdp1_root_summoned(model: torch.nn.Module) -> ContextManager:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel.summon_full_params(model, writeback=False, recurse=False)


@contextmanager
def zero3_gathered(model: torch.nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        yield dict(unwrap_model(model).named_parameters())


for sharding in (
    ParameterSharding("replicated", full_parameters=local_parameters, forward_ready=no_gather, lockstep=False),
    ParameterSharding("fsdp2", full_parameters=fsdp2_unsharded, forward_ready=no_gather, lockstep=True),
    # The unwrapped module's forward skips the root wrapper, whose own parameters (embeddings,
    # head, final norm) it must gather; the nested units gather theirs in their forward.
    ParameterSharding(
        "fsdp1",
        full_parameters=fsdp1_summoned,
        forward_ready=fsdp1_root_summoned,
        lockstep=True,
    ),
    ParameterSharding("zero3", full_parameters=zero3_gathered, forward_ready=no_gather, lockstep=True),
):
    SHARDINGS.add(sharding.name, sharding)


def fsdp_sharding(state: Any) -> str:
    return f"fsdp{state.fsdp_plugin.fsdp_version}"


def deepspeed_sharding(state: Any) -> str:
    return "zero3" if state.deepspeed_plugin.zero_stage == 3 else "replicated"


# How parameters are laid out, by accelerate's distributed type; any type not named replicates them.
SHARDING_BY_DISTRIBUTED_TYPE: dict[str, Callable[[Any], str]] = {"FSDP": fsdp_sharding, "DEEPSPEED": deepspeed_sharding}


def sharding_of(state: Any) -> ParameterSharding:
    """The parameter layout of models prepared under accelerate's ``state`` (an ``AcceleratorState``)."""
    name_of = SHARDING_BY_DISTRIBUTED_TYPE.get(state.distributed_type.name, lambda _: "replicated")
    return SHARDINGS.lookup(name_of(state))


@contextmanager
def forward_model(model: torch.nn.Module, accelerator: Any, sharding: ParameterSharding) -> Iterator[PreTrainedModel]:
    """The unwrapped ``model``, ready to run forwards (generation, log-probs) outside the training
    step; under a ``lockstep`` sharding every process must run the same ones."""
    with sharding.forward_ready(model):
        yield accelerator.unwrap_model(model)


@contextmanager
def sampling_model(model: torch.nn.Module, accelerator: Any, sharding: ParameterSharding) -> Iterator[PreTrainedModel]:
    """:func:`forward_model` in eval mode (no dropout while it samples), its training mode restored after."""
    with forward_model(model, accelerator, sharding) as unwrapped:
        was_training = unwrapped.training
        unwrapped.eval()
        try:
            yield unwrapped
        finally:
            unwrapped.train(was_training)


def check_whole(model: torch.nn.Module) -> None:
    """A reference must hold its own weights. Loaded once a launch's process group is up, it may
    not: under FSDP with ``fsdp_cpu_ram_efficient_loading`` transformers loads the weights on
    rank 0 only (the others on ``meta``), under ZeRO-3 (``zero3_init_flag``) partitioned."""
    for name, param in model.named_parameters():
        if param.is_meta or hasattr(param, "ds_id"):
            raise ValueError(
                f"the reference's parameter {name} holds no weights on this process (loaded under FSDP's "
                "cpu_ram_efficient_loading or ZeRO-3's zero3_init_flag): load the reference before the trainer's "
                "arguments and process group are created"
            )


def prepare_reference(model: ModuleT, accelerator: Any) -> ModuleT:
    """A frozen reference, whole on this process's device: mixed precision applied, never
    sharded (accelerate leaves it unwrapped for evaluation, and in place under FSDP)."""
    check_whole(model)
    model.requires_grad_(False).eval()
    return accelerator.prepare_model(model, evaluation_mode=True).to(accelerator.device)
