"""A vLLM engine as a server of its own (``vllm_mode: server``): generation on other devices or
machines than training, as TRL's ``trl vllm-serve`` and verl's rollout workers do.

The server (``python -m trainers.generation.vllm_server``, ``alignflow vllm-server``) holds one engine in its
process and answers JSON over HTTP; it starts without a model, so it is up before the trainer knows
what it serves. It answers only requests that carry its token (:mod:`trainers.generation.server_auth`: 401
otherwise), and a failed request with a one-line error (the traceback stays in its log):

- ``GET /health``: ``{"model": true|false}``;
- ``POST /load``: build the engine from a model folder (:func:`~trainers.generation.vllm_engine.write_model_folder`);
- ``POST /reload``: reload the weights in place from a safetensors file (then forget the prefix cache);
- ``POST /channel``: open a weight channel (below), on the server's interface, with a secret of its
  own; ``POST /receive``: reload from it;
- ``POST /generate``: token ids in, sampled token ids and their log-probs out.

Each route takes and answers a typed message (:mod:`trainers.generation.server_messages`): a body
that is not its route's message is answered 400, naming each field that is wrong.

It is alignflow's own small server around vLLM's ``LLM`` (the standard library's HTTP server)
rather than ``vllm serve``: the OpenAI server pins a FastAPI that Prefect's does not meet, and its
weight-transfer routes run on GPU-only engines (NCCL, CUDA IPC). Weights travel by a transport
(:data:`WEIGHT_TRANSFERS`):

- ``storage`` writes a safetensors file to a folder both sides read (shared storage between
  machines) and asks the server to reload from it;
- ``collective`` broadcasts them from the trainer's process to the server's over a weight channel
  (:mod:`trainers.generation.weight_channel`: NCCL between GPUs, gloo on CPUs): the server hosts it on a port
  it announces, and for each sync the trainer sends the names, shapes and dtypes, then every tensor
  in that order.

With ``storage`` the model itself is loaded from the transfer folder; with ``collective`` the server
builds its engine from the model's config and the first weights follow over the channel. The server
reads models and weights only under its ``--weights-root``.

:class:`ServerEngine` is the trainer's side: a :class:`~trainers.generation.vllm_engine.SyncedEngine` whose
engine is the server's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import sys
import tempfile
import threading
import urllib.error
import urllib.parse
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
from pydantic import ValidationError

from trainers.generation import weight_channel
from trainers.generation.batcher import Batcher
from trainers.generation.server_auth import authorized, bearer, environment_token
from trainers.generation.server_messages import (
    ChannelAnswer,
    ChannelRequest,
    Done,
    GenerateAnswer,
    GenerateRequest,
    LoadRequest,
    Message,
    ReceiveRequest,
    ReloadRequest,
)
from trainers.generation.transfers import FOLDER_TRANSFERS
from trainers.generation.vllm_engine import (
    EngineOptions,
    EngineSamples,
    GenerationRequest,
    SamplingOptions,
    SyncedEngine,
    build_llm,
    reload_weights,
    require_vllm,
    sample_requests,
    savable,
    served_config,
    write_model_folder,
)

LISTENING = "alignflow vLLM server listening on "  # the line a starter reads the address from
REQUEST_TIMEOUT_S = 600.0  # a build or a generation batch on a slow device
log = logging.getLogger("alignflow.vllm_server")


class ServerError(RuntimeError):
    """The server answered a request with an error (its message is the server's one-line error)."""


class EngineHost:
    """The server's engine: none until ``/load``; one request at a time reaches it, and the
    ``/generate`` requests that wait meanwhile reach it together (:class:`Batcher`). Its weight
    channels listen on ``bind_host``, the server's interface."""

    def __init__(self, weights_root: Path, bind_host: str = "127.0.0.1"):
        self.weights_root = weights_root.resolve()
        self.bind_host = bind_host
        self.llm = None
        self.lock = threading.Lock()
        self.channel: weight_channel.Receiver | None = None
        self.batcher: Batcher[GenerationRequest, EngineSamples] = Batcher(
            lambda requests: sample_requests(self.ready(), requests), self.lock
        )

    def inside_root(self, path: str) -> Path:
        resolved = Path(path).resolve()
        if not resolved.is_relative_to(self.weights_root):
            raise PermissionError(f"{path} is outside the server's weights root {self.weights_root}")
        return resolved

    def load(self, request: LoadRequest) -> Done:
        """Build the engine from a model folder under the weights root, or from a model's config
        alone, with random weights that the weight channel replaces next."""
        device_type = "cuda" if torch.cuda.is_available() else "cpu"  # the server's device, not the trainer's
        settings = (getattr(torch, request.dtype), device_type, request.options, request.seed)
        with self.lock:
            self.llm = None  # the engine before gives its memory back first
            if request.folder is not None:
                self.llm = build_llm(self.inside_root(request.folder), *settings)
            else:
                with tempfile.TemporaryDirectory(prefix="alignflow-vllm-config-") as staging:
                    (Path(staging) / "config.json").write_text(json.dumps(request.config))
                    self.llm = build_llm(staging, *settings, dummy_weights=True)
        return Done()

    def reload(self, request: ReloadRequest) -> Done:
        from safetensors.torch import load_file

        weights = load_file(self.inside_root(request.path))
        with self.lock:
            reload_weights(self.ready(), list(weights.items()))
        return Done()

    def open_channel(self, request: ChannelRequest) -> ChannelAnswer:
        """Host a weight channel (:func:`trainers.generation.weight_channel.host`); the answer is its port and
        the secret its sender presents. A channel opened before is replaced."""
        port, secret, self.channel = weight_channel.host(request.backend, self.bind_host)
        return ChannelAnswer(port=port, secret=secret)

    def receive(self, request: ReceiveRequest) -> Done:
        """Receive the named tensors by the weight channel and reload them in place."""
        llm = self.ready()  # its error before anything is received: the trainer's sends stop on it
        if self.channel is None:
            raise RuntimeError("no weight channel: POST /channel first")
        tensors = self.channel.receive(request.shapes, request.dtypes)
        with self.lock:
            reload_weights(llm, list(zip(request.names, tensors)))
        return Done()

    def generate(self, request: GenerateRequest) -> GenerateAnswer:
        return GenerateAnswer.of(self.batcher.submit((request.prompts, request.seeds, request.sampling)))

    def ready(self):
        if self.llm is None:
            raise RuntimeError("no model loaded: POST /load first")
        return self.llm


def handler_for(host: EngineHost, token: str) -> type[BaseHTTPRequestHandler]:
    """The server's request handler: every route answers only a request that carries ``token``."""
    routes: dict[str, tuple[type[Message], Callable[[Any], Message]]] = {
        "/load": (LoadRequest, host.load),
        "/reload": (ReloadRequest, host.reload),
        "/channel": (ChannelRequest, host.open_channel),
        "/receive": (ReceiveRequest, host.receive),
        "/generate": (GenerateRequest, host.generate),
    }

    class Handler(BaseHTTPRequestHandler):
        def refused(self) -> bool:
            if authorized(self.headers["Authorization"], token):
                return False
            self.answer(401, {"error": "unauthorized: this server answers only requests with its token"})
            return True

        def do_GET(self) -> None:
            if self.refused():
                return
            if self.path == "/health":
                self.answer(200, {"model": host.llm is not None})
            else:
                self.answer(404, {"error": f"no route {self.path}"})

        def do_POST(self) -> None:
            if self.refused():
                return
            if self.path not in routes:
                self.answer(404, {"error": f"no route {self.path}"})
                return
            message, run = routes[self.path]
            try:
                request = message.model_validate_json(self.rfile.read(int(self.headers["Content-Length"])))
            except ValidationError as error:
                self.answer(400, {"error": f"{self.path}: {flat_errors(error)}"})
                return
            try:
                self.answer(200, run(request).model_dump(mode="json"))
            except Exception as error:  # the trainer raises the one line; the traceback stays here
                log.exception("POST %s failed", self.path)
                self.answer(500, {"error": f"{type(error).__name__}: {error}"})

        def answer(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args) -> None:  # noqa: A002 (the base class's name)
            print(f"{self.command} {self.path} {args[1] if len(args) > 1 else ''}", flush=True)

    return Handler


def serve(host: str, port: int, weights_root: Path, token: str) -> None:
    """Serve requests that carry ``token`` until stopped (SIGTERM, SIGINT); ``port`` 0 picks a free
    one, announced on stdout."""
    require_vllm()
    server = ThreadingHTTPServer((host, port), handler_for(EngineHost(weights_root, host), token))
    print(f"{LISTENING}http://{host}:{server.server_address[1]}", flush=True)
    server.serve_forever()


def flat_errors(error: ValidationError) -> str:
    """A request's validation errors on one line: ``field: message; …``."""
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in error.errors())


def post(url: str, route: str, message: Message, token: str) -> dict:
    """``message`` to the server's ``route``; its answer (a :class:`ServerError` with the server's line on an error)."""
    request = urllib.request.Request(
        url.rstrip("/") + route,
        message.model_dump_json().encode(),
        {"Content-Type": "application/json", **bearer(token)},
    )
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        raise ServerError(f"vLLM server {url}{route}: {json.loads(error.read())['error']}") from None


def health(url: str, token: str, timeout: float = 5.0) -> dict:
    """The server's ``/health`` answer; raises ``OSError`` when nothing answers."""
    request = urllib.request.Request(url.rstrip("/") + "/health", headers=bearer(token))
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


Weights = dict[str, torch.Tensor]  # the policy's parameters by name
NamedWeights = list[tuple[str, torch.Tensor]]  # as the engine names them: a tied weight under each name


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """What a ``/load`` builds the server's engine with, besides the model: the weights' dtype, the
    engine options and the seed."""

    dtype: str
    options: EngineOptions
    seed: int

    def fields(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "options": self.options, "seed": self.seed}


class WeightTransfer(Protocol):
    """How a :class:`ServerEngine` gets weights to its server: the model's first load (the server
    builds its engine), then a push of the weights after each step that changed them."""

    def load(self, model: torch.nn.Module, weights: Weights, named: NamedWeights, settings: EngineSettings) -> None:
        """Build the server's engine for ``model`` with ``weights`` (``named``: as the engine names
        them), in ``settings``."""

    def push(self, weights: NamedWeights) -> None: ...


class StorageTransfer:
    """Weights by shared storage: a safetensors file under ``folder`` (written, renamed into place,
    reloaded by the server, removed). The model's first load goes through ``folder`` too: a model
    folder the server builds its engine from."""

    def __init__(self, url: str, token: str, folder: Path):
        self.url, self.token, self.folder = url, token, folder

    def load(self, model: torch.nn.Module, weights: Weights, named: NamedWeights, settings: EngineSettings) -> None:
        staging = self.folder / f"model-{uuid.uuid4().hex}"
        staging.mkdir(parents=True)
        try:
            write_model_folder(model, weights, staging)
            post(self.url, "/load", LoadRequest(**settings.fields(), folder=str(staging)), self.token)
        finally:
            shutil.rmtree(staging)

    def push(self, weights: NamedWeights) -> None:
        from safetensors.torch import save_file

        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"weights-{uuid.uuid4().hex}.safetensors"
        staging = path.with_suffix(".partial")
        try:
            save_file(savable(weights), staging)
            staging.rename(path)
            post(self.url, "/reload", ReloadRequest(path=str(path)), self.token)
        finally:
            staging.unlink(missing_ok=True)
            path.unlink(missing_ok=True)


class CollectiveTransfer:
    """Weights by a weight channel of this process and the server (:mod:`trainers.generation.weight_channel`),
    opened at the first push on the backend of the weights' device: the server is told the names,
    shapes and dtypes (``/receive``, answered once it has reloaded), and meanwhile each tensor is
    broadcast. It carries the model's first weights too: the server builds its engine from the
    config alone."""

    def __init__(self, url: str, token: str):
        self.url, self.token = url, token
        self.group: weight_channel.Channel | None = None
        self.requests = ThreadPoolExecutor(max_workers=1, thread_name_prefix="alignflow-weight-channel")

    def load(self, model: torch.nn.Module, weights: Weights, named: NamedWeights, settings: EngineSettings) -> None:
        config = json.loads(served_config(model).to_json_string())
        post(self.url, "/load", LoadRequest(**settings.fields(), config=config), self.token)
        self.push(named)

    def open(self, backend: str) -> weight_channel.Channel:
        channel = ChannelAnswer.model_validate(post(self.url, "/channel", ChannelRequest(backend=backend), self.token))
        hostname = urllib.parse.urlsplit(self.url).hostname
        if hostname is None:
            raise ValueError(f"the vLLM server's url {self.url!r} names no host to open a weight channel to")
        self.group = weight_channel.join(hostname, channel.port, backend, channel.secret)
        return self.group

    def push(self, weights: NamedWeights) -> None:
        tensors = [tensor.contiguous() for _, tensor in weights]
        group = self.group if self.group is not None else self.open(weight_channel.backend_for(tensors[0].device))
        manifest = ReceiveRequest(
            names=[name for name, _ in weights],
            shapes=[list(tensor.shape) for tensor in tensors],
            dtypes=[str(tensor.dtype).removeprefix("torch.") for tensor in tensors],
        )
        answer = self.requests.submit(post, self.url, "/receive", manifest, self.token)
        weight_channel.send(group, tensors, answer)
        answer.result()


# each transfer by its config name, made from the server's address and token (and, for
# FOLDER_TRANSFERS, the shared folder: weight_transfer)
WEIGHT_TRANSFERS: dict[str, Callable[..., WeightTransfer]] = {
    "storage": StorageTransfer,
    "collective": CollectiveTransfer,
}


def weight_transfer(name: str, url: str, token: str, folder: Path) -> WeightTransfer:
    """The transfer ``name`` to the server at ``url``, through ``folder`` where it loads through one."""
    maker = WEIGHT_TRANSFERS[name]
    return maker(url, token, folder) if name in FOLDER_TRANSFERS else maker(url, token)


class ServerEngine(SyncedEngine):
    """The trainer's side of a vLLM server at ``url``: loads ``model`` with ``weights`` (its
    :func:`~trainers.generation.vllm_engine.serving_weights`, whole) as they are at optimizer step ``step`` into
    the server by ``transfer`` (:meth:`WeightTransfer.load`: a model folder under ``folder``, which the
    server reads too, or the config and then the weights over a channel), then pushes its weights by
    ``transfer`` after each step that changed them. Its requests carry the server's token, from
    this process's environment (:func:`~trainers.generation.server_auth.environment_token`).

    Training processes share the server: each generates its own prompts' completions, one pushes
    (``pushes``: the main process) and every one waits at ``barrier`` after each load and push, so no
    process samples from the weights before."""

    def __init__(
        self,
        model: torch.nn.Module,
        weights: dict[str, torch.Tensor],
        options: EngineOptions,
        seed: int,
        step: int,
        url: str,
        transfer: str,
        folder: Path,
        pushes: bool = True,
        barrier: Callable[[], None] = lambda: None,
    ):
        super().__init__(model, step)
        self.url, self.pushes, self.barrier = url, pushes, barrier
        self.token = environment_token()
        self.transfer = weight_transfer(transfer, url, self.token, folder)
        if pushes:
            dtype = str(next(iter(weights.values())).dtype).removeprefix("torch.")
            settings = EngineSettings(dtype, options, seed)
            self.transfer.load(model, weights, self.named_for_engine(weights), settings)
        barrier()

    def push_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        if self.pushes:
            self.transfer.push(weights)
        self.barrier()

    def generate(self, prompts: list[list[int]], seeds: list[int], sampling: SamplingOptions) -> EngineSamples:
        request = GenerateRequest(prompts=prompts, seeds=seeds, sampling=sampling)
        return GenerateAnswer.model_validate(post(self.url, "/generate", request, self.token)).samples()


def main(argv: list[str]) -> None:
    """``python -m trainers.generation.vllm_server HOST PORT WEIGHTS_ROOT``, its token in the environment: what
    ``alignflow vllm-server`` and the managed server run."""
    host, port, weights_root = argv
    try:
        token = environment_token()
    except ValueError as error:
        print(f"alignflow vllm-server: {error}", file=sys.stderr)
        sys.exit(2)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        serve(host, int(port), Path(weights_root), token)
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
