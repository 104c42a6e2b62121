"""What alignflow reads of transformers' and peft's internals, in one place (contract:
``tests/test_compat.py``): the model a wrapper runs, its attention implementation, whether its
architecture builds masks that keep packed rows apart, the input its output head is called with, and
how ``Trainer.compute_loss`` scales a loss normalised over the accumulation window."""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator, Protocol, runtime_checkable

import torch
from transformers import Trainer, masking_utils
from transformers.modeling_utils import unwrap_model

# The mask builders that detect packed rows from ``position_ids`` (``find_packed_sequence_indices``).
PACKED_MASK_BUILDERS = ("create_causal_mask", "create_sliding_window_causal_mask")


@runtime_checkable
class WrapsBaseModel(Protocol):
    """A peft wrapper: what it wraps."""

    def get_base_model(self) -> torch.nn.Module: ...


def innermost_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model whose ``forward`` finally runs: unwrapped from distributed wrappers, and from a
    peft wrapper (which passes its keyword arguments through to it)."""
    model = unwrap_model(model)
    return model.get_base_model() if isinstance(model, WrapsBaseModel) else model


def attention_implementation(model: torch.nn.Module) -> str:
    """The attention implementation the model runs (``sdpa``, ``eager``, ``flash_attention_2``, …):
    its config's ``_attn_implementation``, which transformers resolves at load time."""
    config = getattr(innermost_model(model), "config", None)
    return str(getattr(config, "_attn_implementation", None))


def masks_from_positions(model: torch.nn.Module) -> bool:
    """Whether the model's architecture builds its attention masks with transformers' masking
    utilities (its modeling module uses their builders), which read packed rows from ``position_ids``."""
    module = sys.modules.get(type(innermost_model(model)).__module__)
    return any(getattr(module, name, None) is getattr(masking_utils, name) for name in PACKED_MASK_BUILDERS)


def classifier_parts(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A sequence classifier's backbone (its ``base_model``) and score head (``score``, the linear
    layer of transformers' ``…ForSequenceClassification``; a peft wrapper's copy when it trains one)."""
    inner = innermost_model(model)
    head, backbone = getattr(inner, "score", None), getattr(inner, "base_model", None)
    if not isinstance(head, torch.nn.Module) or not isinstance(backbone, torch.nn.Module):
        raise TypeError(f"{type(inner).__name__} has no score head: not a transformers sequence classifier")
    return backbone, head


# Architectures whose logits are exactly their output embedding applied to the last hidden state (no
# soft-capping, scaling or bias after it): where the log-prob pass may apply the head itself, in chunks.
PLAIN_HEAD_MODEL_TYPES = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3"})


def plain_output_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The model's output projection when the log-prob pass can apply it itself: a plain ``nn.Linear``
    (not a peft layer) of an architecture in :data:`PLAIN_HEAD_MODEL_TYPES`, whose weight is a whole
    tensor on this process (not sharded by FSDP2 or ZeRO-3). None otherwise."""
    inner = innermost_model(model)
    config = getattr(inner, "config", None)
    if getattr(config, "model_type", None) not in PLAIN_HEAD_MODEL_TYPES:
        return None
    get_head = getattr(inner, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if type(head) is not torch.nn.Linear:
        return None
    weight = head.weight
    if type(weight) not in (torch.nn.Parameter, torch.Tensor) or hasattr(weight, "ds_id"):
        return None
    return head


@contextlib.contextmanager
def head_inputs(head: torch.nn.Module | None) -> Iterator[list[torch.Tensor]]:
    """While the block runs, ``head``'s input is kept (the last hidden states at the kept positions,
    which transformers' causal LMs pass the head as its first argument) and the head applied to none of
    them: the model's forward returns empty logits. ``head`` None: nothing is kept."""
    captured: list[torch.Tensor] = []
    if head is None:
        yield captured
        return

    def keep(module: torch.nn.Module, args: tuple) -> tuple:
        captured.append(args[0])
        return (args[0][..., :0, :], *args[1:])

    handle = head.register_forward_pre_hook(keep)
    try:
        yield captured
    finally:
        handle.remove()


def window_loss_scale(trainer: Trainer) -> int:
    """The factor ``Trainer.compute_loss`` multiplies a loss by when it is a sum over the accumulation
    window's ``num_items_in_batch``, counted over every process (``average_tokens_across_devices``): the
    processes that see batches of their own (``num_processes`` over the tensor-parallel size), or
    ``n_gpu`` under ``DataParallel``; 1 when the count is this process's."""
    if not trainer.args.average_tokens_across_devices:
        return 1
    if trainer.args.n_gpu > 1:
        return trainer.args.n_gpu
    return trainer.accelerator.num_processes // trainer.get_tp_size()
