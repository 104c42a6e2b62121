"""The vLLM server's HTTP routes and weight channel without an engine: errors reach the trainer as
errors, never as a hang (``tests/test_vllm.py`` runs both with vLLM engines)."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from concurrent.futures import Future
from http.server import ThreadingHTTPServer
from typing import Iterator

import psutil
import pytest
import torch

from trainers.generation import weight_channel
from trainers.generation.server_messages import ChannelRequest, ReceiveRequest, ReloadRequest
from trainers.generation.vllm_server import CollectiveTransfer, EngineHost, ServerError, handler_for, post

pytestmark = pytest.mark.slow

TOKEN = "t" * 43  # the server's token in these tests
FAILED_CHANNELS: list[CollectiveTransfer] = []


@pytest.fixture
def server(tmp_path) -> Iterator[str]:
    """A server without a model, in a thread of this process, answering requests with ``TOKEN``; its address."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler_for(EngineHost(tmp_path), TOKEN))
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
    transfer = CollectiveTransfer(server, TOKEN)
    with pytest.raises(ServerError, match="no model loaded: POST /load first"):
        transfer.push([("model.embed_tokens.weight", torch.ones(1024, 1024))])
    assert transfer.group is not None and transfer.group.size() == 2
    # a gloo group whose last broadcast was never received blocks in its destructor: kept to the end
    FAILED_CHANNELS.append(transfer)


def test_the_servers_refusals_name_what_is_missing(server):
    """Each failure answers one line, the exception's type and message: no traceback reaches a client."""
    with pytest.raises(ServerError) as refused:
        post(server, "/receive", ReceiveRequest(names=[], shapes=[], dtypes=[]), TOKEN)
    assert str(refused.value) == f"vLLM server {server}/receive: RuntimeError: no model loaded: POST /load first"
    with pytest.raises(ServerError) as refused:
        post(server, "/reload", ReloadRequest(path="/etc/passwd"), TOKEN)
    assert "Traceback" not in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(ServerError, match="no route /unload"):
        post(server, "/unload", ReloadRequest(path="x"), TOKEN)
    if not torch.cuda.is_available():
        with pytest.raises(
            ServerError, match="a weight channel over NCCL needs a GPU on the server; this one has none"
        ):
            post(server, "/channel", ChannelRequest(backend="nccl"), TOKEN)


def test_a_request_that_is_not_its_routes_message_is_refused_naming_the_fields(server):
    """A body that is not the route's message (a field missing, misspelt or of another type) gets a
    400 that names each field, before anything reaches the engine."""
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    body = b'{"prompts": [[1, 2]], "seed": [0], "sampling": {"temperature": "hot"}}'
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(urllib.request.Request(f"{server}/generate", body, headers), timeout=10)
    assert refused.value.code == 400
    error = json.loads(refused.value.read())["error"]
    assert error.startswith("/generate: seeds: Field required; sampling.temperature: Input should be a valid number")
    assert "seed: Extra inputs are not permitted" in error and "\n" not in error


def status_of(request: urllib.request.Request) -> int:
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


@pytest.mark.parametrize("header", [None, "Bearer " + "x" * 43, "Basic " + TOKEN, TOKEN], ids=str)
def test_a_request_without_the_servers_token_is_refused(server, header):
    """Every route answers 401 to a request without the token (none, another, the wrong scheme), and
    opens no channel; with it, the same requests are answered."""
    headers = {} if header is None else {"Authorization": header}
    assert status_of(urllib.request.Request(f"{server}/health", headers=headers)) == 401
    for route, body in [("/channel", b'{"backend": "gloo"}'), ("/generate", b"{}"), ("/load", b"{}")]:
        assert status_of(urllib.request.Request(server + route, body, headers)) == 401
    with pytest.raises(ServerError, match="401|unauthorized"):
        post(server, "/channel", ChannelRequest(backend="gloo"), "x" * 43)
    assert status_of(urllib.request.Request(f"{server}/health", headers={"Authorization": f"Bearer {TOKEN}"})) == 200


def listening_addresses(port: int) -> set[str]:
    return {
        c.laddr.ip for c in psutil.Process().net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port
    }


def test_a_weight_channel_listens_on_the_servers_interface_and_drops_a_member_without_its_secret():
    """The channel's store listens on the host it was given only (not every interface); a member
    that joins with another secret than the channel's is dropped: the receiver receives nothing
    from it and says why; the channel's own secret admits the sender."""
    port, secret, receiver = weight_channel.host("gloo", "127.0.0.1")
    assert listening_addresses(port) == {"127.0.0.1"} and len(bytes.fromhex(secret)) == weight_channel.SECRET_BYTES
    weight_channel.join("127.0.0.1", port, "gloo", "00" * weight_channel.SECRET_BYTES)
    with pytest.raises(RuntimeError) as refused:
        receiver.receive([[2]], ["float32"])
    assert str(refused.value) == (
        "the member that joined the weight channel did not present its secret; channel closed"
    )
    port, secret, receiver = weight_channel.host("gloo", "127.0.0.1")
    group = weight_channel.join("127.0.0.1", port, "gloo", secret)
    sent = torch.tensor([1.5, -2.0])
    answer: Future = Future()
    threading.Thread(target=lambda: answer.set_result(receiver.receive([[2]], ["float32"]))).start()
    weight_channel.send(group, [sent], answer)
    assert torch.equal(answer.result()[0], sent)


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

    from trainers.generation.transfers import FOLDER_TRANSFERS, WeightTransferName
    from trainers.generation.vllm_server import WEIGHT_TRANSFERS, StorageTransfer, weight_transfer

    assert set(WEIGHT_TRANSFERS) == set(get_args(WeightTransferName)) and FOLDER_TRANSFERS <= set(WEIGHT_TRANSFERS)
    storage = weight_transfer("storage", "http://127.0.0.1:9", TOKEN, tmp_path)
    assert isinstance(storage, StorageTransfer) and storage.folder == tmp_path and storage.token == TOKEN
    assert isinstance(weight_transfer("collective", "http://127.0.0.1:9", TOKEN, tmp_path), CollectiveTransfer)
    for device in ("cpu", "cuda"):
        assert weight_channel.device_for(weight_channel.backend_for(torch.device(device))) == torch.device(device)
    assert weight_channel.backend_for(torch.device("cpu")) == "gloo"
