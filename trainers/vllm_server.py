"""A vLLM engine as a server of its own (``vllm_mode: server``): generation on other devices or
machines than training, as TRL's ``trl vllm-serve`` and verl's rollout workers do.

The server (``python -m trainers.vllm_server``, ``alignflow vllm-server``) holds one engine in its
process and answers JSON over HTTP; it starts without a model, so it is up before the trainer knows
what it serves:

- ``GET /health``: ``{"model": true|false}``;
- ``POST /load``: build the engine from a model folder (:func:`~trainers.vllm_engine.write_model_folder`);
- ``POST /reload``: reload the weights in place from a safetensors file (then forget the prefix cache);
- ``POST /generate``: token ids in, sampled token ids and their log-probs out.

It is alignflow's own small server around vLLM's ``LLM`` (the standard library's HTTP server)
rather than ``vllm serve``: the OpenAI server pins a FastAPI that Prefect's does not meet, and has no
weight reload. Weights travel by a transport (:data:`WEIGHT_TRANSFERS`); ``storage`` writes a
safetensors file to a folder both sides read (shared storage between machines) and asks the server
to reload from it. The server reads models and weights only under its ``--weights-root``.

:class:`ServerEngine` is the trainer's side: a :class:`~trainers.vllm_engine.SyncedEngine` whose
engine is the server's.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import threading
import traceback
import urllib.error
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

import torch

from trainers.vllm_engine import (
    EngineOptions,
    EngineSamples,
    SamplingOptions,
    SyncedEngine,
    build_llm,
    reload_weights,
    require_vllm,
    sample,
    write_model_folder,
)

LISTENING = "alignflow vLLM server listening on "  # the line a starter reads the address from
REQUEST_TIMEOUT_S = 600.0  # a build or a generation batch on a slow device


class ServerError(RuntimeError):
    """The server answered a request with an error (its message carries the server's traceback)."""


class EngineHost:
    """The server's engine: none until ``/load``; one request at a time reaches it."""

    def __init__(self, weights_root: Path):
        self.weights_root = weights_root.resolve()
        self.llm = None
        self.lock = threading.Lock()

    def inside_root(self, path: str) -> Path:
        resolved = Path(path).resolve()
        if not resolved.is_relative_to(self.weights_root):
            raise PermissionError(f"{path} is outside the server's weights root {self.weights_root}")
        return resolved

    def load(self, folder: str, dtype: str, options: dict, seed: int) -> dict:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"  # the server's device, not the trainer's
        with self.lock:
            self.llm = None  # the engine before gives its memory back first
            self.llm = build_llm(
                self.inside_root(folder), getattr(torch, dtype), device_type, EngineOptions(**options), seed
            )
        return {}

    def reload(self, path: str) -> dict:
        from safetensors.torch import load_file

        weights = load_file(self.inside_root(path))
        with self.lock:
            reload_weights(self.ready(), list(weights.items()))
        return {}

    def generate(self, prompts: list[list[int]], seeds: list[int], sampling: dict) -> dict:
        options = SamplingOptions(**{**sampling, "stop_ids": tuple(sampling["stop_ids"])})
        with self.lock:
            samples = sample(self.ready(), prompts, seeds, options)
        return dataclasses.asdict(samples)

    def ready(self):
        if self.llm is None:
            raise RuntimeError("no model loaded: POST /load first")
        return self.llm


def handler_for(host: EngineHost) -> type[BaseHTTPRequestHandler]:
    routes = {"/load": host.load, "/reload": host.reload, "/generate": host.generate}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/health":
                self.answer(200, {"model": host.llm is not None})
            else:
                self.answer(404, {"error": f"no route {self.path}"})

        def do_POST(self) -> None:
            route = routes.get(self.path)
            if route is None:
                self.answer(404, {"error": f"no route {self.path}"})
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                self.answer(200, route(**body))
            except Exception:  # the trainer raises it, with this traceback
                self.answer(500, {"error": traceback.format_exc()})

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


def serve(host: str, port: int, weights_root: Path) -> None:
    """Serve until stopped (SIGTERM, SIGINT); ``port`` 0 picks a free one, announced on stdout."""
    require_vllm()
    server = ThreadingHTTPServer((host, port), handler_for(EngineHost(weights_root)))
    print(f"{LISTENING}http://{host}:{server.server_address[1]}", flush=True)
    server.serve_forever()


def post(url: str, route: str, payload: dict) -> dict:
    request = urllib.request.Request(
        url.rstrip("/") + route, json.dumps(payload).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        raise ServerError(f"vLLM server {url}{route}: {json.loads(error.read())['error']}") from None


def health(url: str, timeout: float = 5.0) -> dict:
    """The server's ``/health`` answer; raises ``OSError`` when nothing answers."""
    with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout) as response:
        return json.loads(response.read())


class StorageTransfer:
    """Weights by shared storage: a safetensors file under ``folder`` (written, renamed into place,
    reloaded by the server, removed)."""

    def __init__(self, url: str, folder: Path):
        self.url, self.folder = url, folder

    def push(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        from safetensors.torch import save_file

        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"weights-{uuid.uuid4().hex}.safetensors"
        staging = path.with_suffix(".partial")
        # a tied weight comes twice, sharing storage, which safetensors refuses: each name gets its own copy
        seen: set[int] = set()
        tensors = {}
        for name, tensor in weights:
            shared = tensor.data_ptr() in seen
            seen.add(tensor.data_ptr())
            tensors[name] = tensor.clone() if shared else tensor.contiguous()
        try:
            save_file(tensors, staging)
            staging.rename(path)
            post(self.url, "/reload", {"path": str(path)})
        finally:
            staging.unlink(missing_ok=True)
            path.unlink(missing_ok=True)


WEIGHT_TRANSFERS = {"storage": StorageTransfer}


class ServerEngine(SyncedEngine):
    """The trainer's side of a vLLM server at ``url``: loads ``model`` as it is at optimizer step
    ``step`` into the server (through ``folder``, which the server reads too), then pushes its
    weights by ``transfer`` after each step that changed them.

    Training processes share the server: each generates its own prompts' completions, one pushes
    (``pushes``: the main process) and every one waits at ``barrier`` after each load and push, so no
    process samples from the weights before."""

    def __init__(
        self,
        model: torch.nn.Module,
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
        self.transfer = WEIGHT_TRANSFERS[transfer](url, folder)
        if pushes:
            self.load(model, options, seed, folder)
        barrier()

    def load(self, model: torch.nn.Module, options: EngineOptions, seed: int, folder: Path) -> None:
        staging = folder / f"model-{uuid.uuid4().hex}"
        staging.mkdir(parents=True)
        try:
            write_model_folder(model, staging)
            dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
            post(
                self.url,
                "/load",
                {"folder": str(staging), "dtype": dtype, "options": dataclasses.asdict(options), "seed": seed},
            )
        finally:
            shutil.rmtree(staging)

    def push_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        if self.pushes:
            self.transfer.push(weights)
        self.barrier()

    def generate(self, prompts: list[list[int]], seeds: list[int], sampling: SamplingOptions) -> EngineSamples:
        answer = post(
            self.url, "/generate", {"prompts": prompts, "seeds": seeds, "sampling": dataclasses.asdict(sampling)}
        )
        return EngineSamples(answer["tokens"], answer["logps"])


def main(argv: list[str]) -> None:
    """``python -m trainers.vllm_server HOST PORT WEIGHTS_ROOT``: what ``alignflow vllm-server`` and
    the managed server run."""
    host, port, weights_root = argv
    try:
        serve(host, int(port), Path(weights_root))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
