"""What the vLLM server's routes take and answer (:mod:`trainers.generation.vllm_server`): one typed
message per request and answer, validated when it arrives, so a misspelt or missing field is the
route's one-line error rather than a ``KeyError`` deep in the engine."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from trainers.generation.vllm_engine import EngineOptions, EngineSamples, SamplingOptions


class Message(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class LoadRequest(Message):
    """``/load``: build the engine in ``dtype`` with ``options`` and ``seed``, from a model ``folder``
    under the server's weights root, or from a model's ``config`` (its ``config.json``) with random
    weights, which the weight channel replaces next."""

    dtype: str
    options: EngineOptions
    seed: int
    folder: str | None = None
    config: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_source(self) -> LoadRequest:
        if (self.folder is None) == (self.config is None):
            raise ValueError("a /load request names a model folder or a model config, one of them")
        return self


class ReloadRequest(Message):
    """``/reload``: reload the weights in place from a safetensors file under the weights root."""

    path: str


class ChannelRequest(Message):
    """``/channel``: host a weight channel on ``backend`` (``gloo``, ``nccl``)."""

    backend: str


class ChannelAnswer(Message):
    """The channel's port, and the secret its sender presents first."""

    port: int
    secret: str


class ReceiveRequest(Message):
    """``/receive``: the tensors the trainer broadcasts next over the channel, in order."""

    names: list[str]
    shapes: list[list[int]]
    dtypes: list[str]


class GenerateRequest(Message):
    """``/generate``: one completion per prompt, each under its own seed."""

    prompts: list[list[int]]
    seeds: list[int]
    sampling: SamplingOptions


class GenerateAnswer(Message):
    """Per prompt, the sampled tokens and their log-probs (:class:`EngineSamples`)."""

    tokens: list[list[int]]
    logps: list[list[float]]

    @classmethod
    def of(cls, samples: EngineSamples) -> GenerateAnswer:
        return cls(tokens=samples.tokens, logps=samples.logps)

    def samples(self) -> EngineSamples:
        return EngineSamples(self.tokens, self.logps)


class Done(Message):
    """The answer of a route that returns nothing but its success."""
