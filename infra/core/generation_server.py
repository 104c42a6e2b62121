"""A managed vLLM server (:mod:`trainers.generation.vllm_server`) for a stage that generates in server mode
without a server's address: started on this machine, health-checked, its output handed over line by
line, stopped when the block ends however it ends. It runs as a process group tied to this process
(:class:`~infra.core.launching.ProcessGroup`): a cancelled flow run stops it as it stops a launch,
and a SIGKILLed one takes it along (``PR_SET_PDEATHSIG``).

Each start makes a fresh token (:mod:`trainers.generation.server_auth`), handed to the server by its environment
and set in this process's environment for the block, where the trainer, here or in the ranks a
launch starts from this process, finds it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Sequence

from infra.core.launching import ProcessGroup, output_reader

STARTUP_TIMEOUT_S = 300.0  # importing vLLM, then binding: seconds here; minutes on a cold GPU node


class ServerFailed(RuntimeError):
    """The managed server exited or did not answer in time."""


def server_devices(gpus: Sequence[int] | None) -> dict[str, str]:
    """The environment that gives the server ``gpus`` alone (none: the devices it finds)."""
    return {} if gpus is None else {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))}


@contextmanager
def managed_generation_server(
    weights_root: Path,
    on_line: Callable[[str], None],
    startup_timeout: float = STARTUP_TIMEOUT_S,
    gpus: Sequence[int] | None = None,
) -> Iterator[str]:
    """The address of a vLLM server started on loopback for the block, reading models and weights
    under ``weights_root``, answering only requests with a token made for it (in
    ``ALIGNFLOW_VLLM_TOKEN`` for the block), on ``gpus`` alone where given (its
    ``CUDA_VISIBLE_DEVICES``); ``on_line`` gets each line of its output."""
    from trainers.generation.server_auth import TOKEN_VARIABLE, new_token
    from trainers.generation.vllm_server import LISTENING, health

    weights_root.mkdir(parents=True, exist_ok=True)
    token, before = new_token(), os.environ.get(TOKEN_VARIABLE)
    command = [sys.executable, "-m", "trainers.generation.vllm_server", "127.0.0.1", "0", str(weights_root)]
    env = os.environ | {TOKEN_VARIABLE: token} | server_devices(gpus)
    group = ProcessGroup.start(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: deque[str] = deque(maxlen=40)
    addresses: list[str] = []

    def handle(line: str) -> None:
        if line.startswith(LISTENING):
            addresses.append(line.removeprefix(LISTENING))
        on_line(line)

    reader = output_reader(group.output(), handle, tail, "vllm-server")
    try:
        deadline = time.monotonic() + startup_timeout
        while not addresses:
            if group.poll() is not None or time.monotonic() > deadline:
                reader.join(timeout=5)
                why = f"exited with status {group.poll()}" if group.poll() is not None else "did not start in time"
                raise ServerFailed("\n".join([f"the vLLM server ({' '.join(command)}) {why}; its output:", *tail]))
            group.pause(0.1)
        health(addresses[0], token)  # it answers: the address is right
        os.environ[TOKEN_VARIABLE] = token
        yield addresses[0]
    finally:
        if before is None:
            os.environ.pop(TOKEN_VARIABLE, None)
        else:
            os.environ[TOKEN_VARIABLE] = before
        group.stop()
        reader.join(timeout=5)
