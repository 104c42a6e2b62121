"""The vLLM server's HTTP routes and weight channel without an engine: errors reach the trainer as
errors, never as a hang (``tests/test_vllm.py`` runs both with vLLM engines)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from http.server import ThreadingHTTPServer
from typing import Iterator

import pytest
import torch

from trainers.generation.vllm_server import CollectiveTransfer, EngineHost, ServerError, handler_for, post

pytestmark = pytest.mark.slow


@pytest.fixture
def server(tmp_path) -> Iterator[str]:
    """A server without a model, in a thread of this process; its address."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler_for(EngineHost(tmp_path)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_push_to_a_server_without_a_model_fails_with_the_servers_error(server):
    """The channel opens (gloo, both members in this process), the server refuses the reload before
    it receives anything, and the trainer's sends stop on that answer: 4 MiB is more than a socket
    buffers, so a send that waited for the receiver would hang for the channel's timeout."""
    transfer = CollectiveTransfer(server)
    with pytest.raises(ServerError, match="no model loaded: POST /load first"):
        transfer.push([("model.embed_tokens.weight", torch.ones(1024, 1024))])
    assert transfer.group is not None and transfer.group.size() == 2


def test_the_servers_refusals_name_what_is_missing(server):
    with pytest.raises(ServerError, match="no model loaded: POST /load first"):
        post(server, "/receive", {"names": [], "shapes": [], "dtypes": []})
    with pytest.raises(ServerError, match="no route /unload"):
        post(server, "/unload", {})
    if not torch.cuda.is_available():
        with pytest.raises(
            ServerError, match="a weight channel over NCCL needs a GPU on the server; this one has none"
        ):
            post(server, "/channel", {"backend": "nccl"})


class Broadcasts:
    """The sender's side of a channel whose receiver answers ``answer`` once it has the tensor at
    ``answered_at``, before this side sees that send complete (as gloo may order them)."""

    def __init__(self, answer: Future, answered_at: int, result: dict | Exception):
        self.answer, self.answered_at, self.result = answer, answered_at, result
        self.sent, self.waited = [], 0

    def broadcast(self, tensor: torch.Tensor, root: int) -> Broadcasts:
        assert root == 0
        self.sent.append(tensor)
        if len(self.sent) - 1 == self.answered_at:
            if isinstance(self.result, Exception):
                self.answer.set_exception(self.result)
            else:
                self.answer.set_result(self.result)
        return self

    def is_completed(self) -> bool:
        return len(self.sent) - 1 != self.answered_at  # that one's completion is not seen yet

    def wait(self) -> bool:
        self.waited += 1
        return True


@pytest.mark.parametrize(
    "answered_at, result, raised",
    [
        (2, {"loaded": 3}, None),  # success once it has the last one: every send completes
        (2, ServerError("the load failed"), "the load failed"),
        (0, {"loaded": 3}, "the receiver answered before it received every tensor"),
    ],
    ids=["success-at-the-last", "error", "success-too-early"],
)
def test_a_send_ends_with_the_receivers_answer_whenever_it_arrives(answered_at, result, raised):
    from trainers.generation import weight_channel

    tensors = [torch.full((2,), float(i)) for i in range(3)]
    answer: Future = Future()
    group = Broadcasts(answer, answered_at, result)
    if raised is None:
        weight_channel.send(group, tensors, answer)
        assert (group.sent, group.waited) == (tensors, 3)
    else:
        with pytest.raises((ServerError, RuntimeError), match=raised):
            weight_channel.send(group, tensors, answer)
        assert group.sent == tensors[: answered_at + 1]


def test_every_configurable_transfer_has_a_maker_and_only_folder_transfers_hold_the_folder(tmp_path):
    """The config's ``vllm_weight_transfer`` names are exactly the server's transfers; a storage
    transfer writes below the folder, a collective one has none; a channel's backend and the device
    it receives on are each other's inverse."""
    from typing import get_args

    from trainers.generation import weight_channel
    from trainers.generation.transfers import FOLDER_TRANSFERS, WeightTransferName
    from trainers.generation.vllm_server import WEIGHT_TRANSFERS, StorageTransfer, weight_transfer

    assert set(WEIGHT_TRANSFERS) == set(get_args(WeightTransferName)) and FOLDER_TRANSFERS <= set(WEIGHT_TRANSFERS)
    storage = weight_transfer("storage", "http://127.0.0.1:9", tmp_path)
    assert isinstance(storage, StorageTransfer) and storage.folder == tmp_path
    assert isinstance(weight_transfer("collective", "http://127.0.0.1:9", tmp_path), CollectiveTransfer)
    for device in ("cpu", "cuda"):
        assert weight_channel.device_for(weight_channel.backend_for(torch.device(device))) == torch.device(device)
    assert weight_channel.backend_for(torch.device("cpu")) == "gloo"
