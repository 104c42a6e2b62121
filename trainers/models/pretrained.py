"""Loading causal LMs and their tokenizers from any checkpoint (local path or hub id)."""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from trainers.models.devices import torch_dtype

# ``from_pretrained`` options of every model the pipeline loads. transformers ≥ 5.2x "kernelizes" a
# model by default once the ``kernels`` package (its own dependency) is installed: on CUDA it swaps
# layers for kernels fetched from the Hugging Face Hub at run time, which fails offline and changes
# the numbers from one hub revision to the next. The pipeline runs the model's own code.
LOAD_OPTIONS = {"use_kernels": False}
# Where ``from_pretrained`` reports the weights a load found missing, unused or mismatched (its "load report").
LOAD_REPORT_LOGGER = "transformers.modeling_utils"
LOGGER = logging.getLogger(__name__)


class ModelLoader(Protocol):
    """A transformers auto class (``AutoModelForCausalLM``, ``AutoModelForSequenceClassification``):
    what loads a checkpoint as a model with some head. What it returns depends on its options (the
    model; with ``output_loading_info``, the model and its load report)."""

    def from_pretrained(self, pretrained_model_name_or_path: str, *args: Any, **kwargs: Any) -> Any: ...


def load_tokenizer(path: str, revision: str | None = None, chat_template: str | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer of ``path``, with ``chat_template`` (``data.chat_template``'s text, as the data was
    prepared with it: :attr:`infra.core.handles.PreparedData.chat_template`) over its own template when
    given: the end-of-turn stop set reads the template, and a trainer saves the tokenizer with its model."""
    tokenizer = AutoTokenizer.from_pretrained(path, revision=revision)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    if tokenizer.pad_token is None and tokenizer.eos_token is None:
        raise ValueError(
            f"the tokenizer of {path} has neither a pad token nor an EOS token: give it an EOS token (completions "
            "end with it, and batches are padded with it when there is no pad token)"
        )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(
    path: str,
    revision: str | None = None,
    dtype: str = "auto",
    device: torch.device | str | None = None,
    chat_template: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model in ``dtype`` (``auto``: the checkpoint's own; see ``compute.dtype``), on ``device``
    (None: where transformers puts it, the CPU; a Trainer moves it to its own device), and its tokenizer
    (with ``chat_template`` over its own: :func:`load_tokenizer`)."""
    tokenizer = load_tokenizer(path, revision, chat_template)
    model = AutoModelForCausalLM.from_pretrained(path, revision=revision, dtype=torch_dtype(dtype), **LOAD_OPTIONS)
    if device is not None:
        module: torch.nn.Module = model  # transformers' @wraps(Module.to) leaves its own ``to`` unbound for mypy
        module.to(device)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def check_same_vocabulary(
    own: PreTrainedTokenizerBase, other: PreTrainedTokenizerBase, other_role: str, why: str
) -> None:
    """``other`` (``other_role``: "the teacher /path") reads the token ids ``own`` writes."""
    if own.get_vocab() != other.get_vocab():
        raise ValueError(
            f"{other_role} has another tokenizer ({len(other)} vs {len(own)} tokens, or the same count with other "
            f"ids): {why}"
        )


def load_with_new_head(
    auto_class: ModelLoader, path: str, revision: str | None = None, dtype: str = "auto", **options: Any
) -> PreTrainedModel:
    """``auto_class.from_pretrained`` of a checkpoint saved with another head (a sequence classifier
    from a causal LM). The weights outside the shared base model (``base_model_prefix``) are expected
    to be missing (the new head, initialised fresh) or unused (the old head): transformers' load
    report of them, a warning table, becomes one INFO line. Any other missing, unused or mismatched
    weight keeps the report."""
    held: list[logging.LogRecord] = []
    loading_thread = threading.get_ident()

    def hold(record: logging.LogRecord) -> bool:
        """Holds back this thread's records (another thread's load reports as usual)."""
        if record.thread != loading_thread:
            return True
        held.append(record)
        return False

    report = logging.getLogger(LOAD_REPORT_LOGGER)
    report.addFilter(hold)
    model: PreTrainedModel
    loading: dict[str, list[Any]]  # missing, unexpected and mismatched keys
    try:
        model, loading = auto_class.from_pretrained(
            path, revision=revision, dtype=torch_dtype(dtype), output_loading_info=True, **LOAD_OPTIONS, **options
        )
    finally:
        report.removeFilter(hold)
    base = f"{model.base_model_prefix}."
    missing, unused = loading["missing_keys"], loading["unexpected_keys"]
    if loading["mismatched_keys"] or any(key.startswith(base) for key in (*missing, *unused)):
        for record in held:
            report.handle(record)
    else:
        LOGGER.info("%s: a new %s head, %s initialised fresh", path, type(model).__name__, ", ".join(sorted(missing)))
    return model
