"""A weight channel: a process group of two processes, a trainer (member 0, which sends) and a vLLM
server (member 1, which receives), for the ``collective`` weight transfer
(:mod:`trainers.generation.vllm_server`). NCCL between GPUs, gloo on CPUs: TRL's communicator pattern.

The group is built from torch's own process-group classes on a ``TCPStore`` that the receiver
hosts, not by ``init_process_group``: neither side's default group (a launch's ranks, vLLM's own)
is touched. The store listens on the interface it is given (a socket bound here and handed to it:
torch's own would listen on every interface), the server's.

The store has no authentication, so the channel carries its own: the receiver makes a random
secret per channel, which the trainer learns only from the server's authenticated answer; the
sender's first broadcast is that secret, and the receiver drops a member that presents another
(docs/security.md says what this does and does not protect).
"""

from __future__ import annotations

import dataclasses
import datetime
import hmac
import secrets
import socket
import threading
import time
from concurrent.futures import Future
from typing import Protocol, cast

import torch

TIMEOUT = datetime.timedelta(minutes=10)  # a member waits this long for the other
SECRET_BYTES = 32


class Channel(Protocol):
    """What a member does with its group: broadcast a tensor from member ``root``."""

    def broadcast(self, tensor: torch.Tensor, root: int) -> torch.distributed.Work: ...


def pair_group(store: torch.distributed.Store, member: int, backend: str) -> Channel:
    """A process group of two on ``store``, this process as ``member``; returns once the other
    member has joined too."""
    # torch's stubs leave out the broadcast(tensor, root) that each backend class binds
    if backend == "nccl":
        # the binding's (store, rank, size) form, which torch's stub leaves out too
        return cast(Channel, torch.distributed.ProcessGroupNCCL(store, member, 2))  # type: ignore[call-arg]
    return cast(Channel, torch.distributed.ProcessGroupGloo(store, member, 2, TIMEOUT))


# each backend by the kind of device whose tensors it moves
BACKENDS = {"cuda": "nccl", "cpu": "gloo"}


def backend_for(device: torch.device) -> str:
    """The backend that moves tensors on ``device``."""
    return BACKENDS["cuda" if device.type == "cuda" else "cpu"]


def device_for(backend: str) -> torch.device:
    """The device a member of a ``backend`` channel receives tensors on (its inverse)."""
    return torch.device(next(kind for kind, name in BACKENDS.items() if name == backend))


@dataclasses.dataclass
class Receiver:
    """The receiving member: its group once joined (in the background, while the sender joins from
    its side), the device tensors arrive on."""

    joining: threading.Thread
    device: torch.device
    group: Channel | None = None
    refused: str | None = None  # why the member that joined was dropped

    def admit(self, group: Channel, secret: bytes) -> None:
        """Keep ``group`` if its sender's first broadcast is ``secret``."""
        presented = torch.zeros(SECRET_BYTES, dtype=torch.uint8, device=self.device)
        group.broadcast(presented, 0).wait()
        if hmac.compare_digest(bytes(presented.cpu().tolist()), secret):
            self.group = group
        else:
            self.refused = "the member that joined the weight channel did not present its secret; channel closed"

    def receive(self, shapes: list[list[int]], dtypes: list[str]) -> list[torch.Tensor]:
        """Tensors of these shapes and dtypes, in the order the sender broadcasts them."""
        self.joining.join()
        if self.group is None:
            raise RuntimeError(self.refused or "the weight channel's sender never joined")
        tensors = [
            torch.empty(shape, dtype=getattr(torch, dtype), device=self.device) for shape, dtype in zip(shapes, dtypes)
        ]
        for tensor in tensors:
            self.group.broadcast(tensor, 0).wait()
        return tensors


def listening_socket(bind_host: str) -> socket.socket:
    """A socket listening on a free port of ``bind_host``'s interface ("0.0.0.0", "::": every one)."""
    family, kind, proto, _, address = socket.getaddrinfo(bind_host, 0, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    listener.bind(address)
    listener.listen()
    return listener


def host(backend: str, bind_host: str) -> tuple[int, str, Receiver]:
    """Host a channel's store on a free port of ``bind_host`` and join it as member 1 once a sender
    joins as member 0 and presents the channel's secret: the port and the secret (hex, for the
    sender only) and the receiver."""
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("a weight channel over NCCL needs a GPU on the server; this one has none")
    listener = listening_socket(bind_host)
    port = listener.getsockname()[1]
    store = torch.distributed.TCPStore(
        bind_host, port, 2, is_master=True, timeout=TIMEOUT, wait_for_workers=False, master_listen_fd=listener.detach()
    )
    secret = secrets.token_bytes(SECRET_BYTES)

    def join() -> None:
        receiver.admit(pair_group(store, 1, backend), secret)

    receiver = Receiver(threading.Thread(target=join, daemon=True), device_for(backend))
    receiver.joining.start()
    return port, secret.hex(), receiver


def join(host_name: str, port: int, backend: str, secret: str) -> Channel:
    """The sender's member of the channel hosted at ``host_name:port``, admitted by ``secret``."""
    store = torch.distributed.TCPStore(host_name, port, 2, is_master=False, timeout=TIMEOUT)
    group = pair_group(store, 0, backend)
    presented = torch.tensor(list(bytes.fromhex(secret)), dtype=torch.uint8, device=device_for(backend))
    group.broadcast(presented, 0).wait()
    return group


def send(group: Channel, tensors: list[torch.Tensor], answer: Future) -> None:
    """Broadcast ``tensors`` in order, unless the receiver's side answers with an error first
    (``answer``: its reply to the request that announced them), where a send to a member that stopped
    receiving would wait out the channel's timeout. The receiver answers success only once it has
    every tensor, which may be before this side sees its last send complete."""
    for index, tensor in enumerate(tensors):
        work = group.broadcast(tensor, 0)
        while not work.is_completed() and not answer.done():
            time.sleep(0.001)
        if answer.done():
            answer.result()  # the receiver's error
            if index < len(tensors) - 1:
                raise RuntimeError("the receiver answered before it received every tensor")
        work.wait()
