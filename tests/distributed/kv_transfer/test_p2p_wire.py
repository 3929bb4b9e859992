"""P2pZmqConnector's transport over real ZMQ sockets on loopback: layers arrive bit-exact
and are acknowledged, a full buffer refuses a transfer, an absent consumer times the
transfer out, late layers of a claimed transfer are ignored, a sender without the KV secret is refused
in the CURVE handshake; and its params parse."""

from __future__ import annotations

import socket
import time

import pytest
import torch
import zmq

from kvserve.distributed.kv_transfer.kv_connector.connectors.p2p_params import (
    check_params,
    parse_recv,
    parse_send,
    prompt_hash,
)
from kvserve.distributed.kv_transfer.kv_connector.connectors.p2p_wire import (
    AUTH_FAILED,
    Arrival,
    LayerHeader,
    PeerSender,
    Receiver,
)
from kvserve.kvcache.integrity import KeyedKVAuthenticator
from kvserve.utils.kv_secret import read_kv_secret
from kvserve.utils.zmq_curve import PLAIN_SOCKETS, socket_security

# The session's KV secret (tests/conftest.py): the sockets speak CURVE, as engines' do.
SECURITY = socket_security(read_kv_secret(None))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _layers(n: int, dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    return [torch.randn(2, 3, 16, 3, 64).to(dtype) for _ in range(n)]


def _header(transfer_id: str, i: int, n: int, t: torch.Tensor) -> LayerHeader:
    return LayerHeader(
        transfer_id=transfer_id, layer_index=i, num_layers=n, layer_name=f"layers.{i}",
        dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape), num_tokens=40,
        prompt_hash="h",
    )  # fmt: skip


def _wait(predicate: object, timeout: float = 5.0) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()  # type: ignore[operator]
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError("timed out")


@pytest.fixture
def context() -> zmq.Context:
    ctx = zmq.Context()
    yield ctx
    ctx.term()


def test_layers_arrive_exactly_and_are_acknowledged(context: zmq.Context) -> None:
    port = _port()
    receiver = Receiver(f"tcp://127.0.0.1:{port}", 1 << 30, ttl_s=60, security=SECURITY)
    sender = PeerSender(context, f"tcp://127.0.0.1:{port}", timeout_s=5, security=SECURITY)
    try:
        layers = _layers(4)
        assert receiver.take("t1") is None  # nothing yet
        for i, t in enumerate(layers):
            sender.send_layer("req-1", _header("t1", i, 4, t), t)
        arrival = _wait(lambda: receiver.take("t1"))
        assert isinstance(arrival, Arrival) and arrival.complete
        for i, t in enumerate(layers):
            assert torch.equal(arrival.layers[f"layers.{i}"], t)
        assert arrival.num_bytes == sum(t.numel() * 2 for t in layers)
        [(req_id, ok, num_bytes, _)] = _wait(sender.take_done)  # type: ignore[misc]
        assert (req_id, ok, num_bytes) == ("req-1", True, arrival.num_bytes)
        assert receiver.buffered_bytes == 0  # claimed: out of the buffer
        # A late duplicate of a claimed transfer is not filed again.
        sender.send_layer("req-1", _header("t1", 0, 4, layers[0]), layers[0])
        time.sleep(0.2)
        assert receiver.take("t1") is None and receiver.buffered_bytes == 0
    finally:
        sender.close()
        receiver.close()


def test_a_full_buffer_refuses_the_transfer(context: zmq.Context) -> None:
    port = _port()
    layers = _layers(3, torch.float32)
    receiver = Receiver(
        f"tcp://127.0.0.1:{port}", layers[0].numel() * 4 * 2, ttl_s=60, security=SECURITY
    )
    sender = PeerSender(context, f"tcp://127.0.0.1:{port}", timeout_s=5, security=SECURITY)
    try:
        for i, t in enumerate(layers):
            sender.send_layer("req-2", _header("t2", i, 3, t), t)
        why = _wait(lambda: receiver.take("t2"))
        assert isinstance(why, str) and "full" in why
        [(req_id, ok, _, _)] = _wait(sender.take_done)  # type: ignore[misc]
        assert (req_id, ok) == ("req-2", False)
        assert receiver.buffered_bytes == 0
    finally:
        sender.close()
        receiver.close()


def test_a_layer_from_another_tp_rank_is_refused(context: zmq.Context) -> None:
    """Under TP each receiver holds its own rank's KV heads: rank 1 of 2 refuses KV that
    rank 0 sent, or that a producer of another TP size sent."""
    port = _port()
    receiver = Receiver(
        f"tcp://127.0.0.1:{port}", 1 << 30, ttl_s=60, tp_rank=1, tp_size=2, security=SECURITY
    )
    sender = PeerSender(context, f"tcp://127.0.0.1:{port}", timeout_s=5, security=SECURITY)
    try:
        t = _layers(1)[0]
        for transfer_id, rank, size in (("t5", 0, 2), ("t6", 1, 4)):
            header = _header(transfer_id, 0, 1, t)
            header.tp_rank, header.tp_size = rank, size
            sender.send_layer(f"req-{transfer_id}", header, t)
            why = _wait(lambda transfer_id=transfer_id: receiver.take(transfer_id))
            assert isinstance(why, str) and f"TP rank {rank} of tp_size {size}" in why
        done: list[tuple[str, bool, int, float]] = []
        _wait(lambda: done.extend(sender.take_done()) or len(done) == 2)
        assert sorted((req_id, ok) for req_id, ok, _, _ in done) == [
            ("req-t5", False),
            ("req-t6", False),
        ]
        assert receiver.buffered_bytes == 0
    finally:
        sender.close()
        receiver.close()


def test_no_consumer_times_the_transfer_out(context: zmq.Context) -> None:
    sender = PeerSender(context, f"tcp://127.0.0.1:{_port()}", timeout_s=0.3, security=SECURITY)
    try:
        t = _layers(1)[0]
        sender.send_layer("req-3", _header("t3", 0, 1, t), t)
        [(req_id, ok, _, seconds)] = _wait(sender.take_done)  # type: ignore[misc]
        assert (req_id, ok) == ("req-3", False) and seconds >= 0.3
    finally:
        sender.close()


def test_an_unclaimed_transfer_expires(context: zmq.Context) -> None:
    port = _port()
    receiver = Receiver(f"tcp://127.0.0.1:{port}", 1 << 30, ttl_s=0.3, security=SECURITY)
    sender = PeerSender(context, f"tcp://127.0.0.1:{port}", timeout_s=5, security=SECURITY)
    try:
        t = _layers(1)[0]
        sender.send_layer("req-4", _header("t4", 0, 2, t), t)  # 1 of 2 layers
        _wait(lambda: receiver.buffered_bytes > 0)
        _wait(lambda: receiver.buffered_bytes == 0, timeout=3)
        assert receiver.take("t4") is None
    finally:
        sender.close()
        receiver.close()


def test_params() -> None:
    send = parse_send({"do_remote_decode": True, "remote_host": "h", "remote_port": 9})
    assert send is not None and send.address == "tcp://h:9" and send.transfer_id is None
    recv = parse_recv(
        {"do_remote_prefill": True, "transfer_id": "x", "num_tokens": 3, "prompt_hash": "p"}
    )
    assert recv is not None and recv.num_tokens == 3 and recv.tp_size == 1  # missing: 1
    recv = parse_recv(
        {"do_remote_prefill": True, "transfer_id": "x", "num_tokens": 3, "prompt_hash": "p",
         "tp_size": 3}
    )  # fmt: skip
    assert recv is not None and recv.tp_size == 3
    with pytest.raises(ValueError, match="tp_size must be >= 1"):
        check_params(
            {"do_remote_prefill": True, "transfer_id": "x", "num_tokens": 3, "prompt_hash": "p",
             "tp_size": 0}
        )  # fmt: skip
    assert parse_send({"foo": 1}) is None and parse_recv(None) is None
    with pytest.raises(ValueError, match="remote_port must be in"):
        check_params({"do_remote_decode": True, "remote_host": "h", "remote_port": 0})
    with pytest.raises(ValueError, match="remote_host must be a string"):
        check_params({"do_remote_decode": True, "remote_port": 9})
    with pytest.raises(ValueError, match="num_tokens must be an integer"):
        check_params({"do_remote_prefill": True, "transfer_id": "x", "num_tokens": True})
    assert prompt_hash([1, 2, 3]) == prompt_hash([1, 2, 3]) != prompt_hash([1, 2, 4])


@pytest.mark.parametrize("how", ["forged", "moved"])
def test_an_unauthenticated_layer_refuses_the_transfer(context: zmq.Context, how: str) -> None:
    secret = b"the engines' shared KV secret..."
    port = _port()
    receiver = Receiver(
        f"tcp://127.0.0.1:{port}",
        1 << 30,
        ttl_s=60,
        auth=KeyedKVAuthenticator(secret),
        security=SECURITY,
    )
    # forged: a peer's own secret. moved: the right secret, but the MAC was made for
    # another transfer (a valid layer replayed under another transfer id).
    auth = KeyedKVAuthenticator(secret if how == "moved" else b"an attacker's own secret")
    if how == "moved":
        genuine = auth.tag
        auth.tag = lambda key, header, payload: genuine(  # type: ignore[method-assign]
            key.replace("planted", "genuine"), header.replace(b"planted", b"genuine"), payload
        )
    sender = PeerSender(
        context, f"tcp://127.0.0.1:{port}", timeout_s=5, auth=auth, security=SECURITY
    )
    try:
        [layer] = _layers(1)
        sender.send_layer("r", _header("planted", 0, 1, layer), layer)
        assert _wait(lambda: receiver.take("planted")) == AUTH_FAILED
        assert receiver.auth_failures == 1
        [(req_id, ok, _, _)] = _wait(sender.take_done)  # type: ignore[misc]
        assert (req_id, ok) == ("r", False)
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("stranger", ["another secret", "plaintext"])
def test_a_sender_without_the_secret_is_refused_before_its_payload_is_read(
    context: zmq.Context, stranger: str
) -> None:
    port = _port()
    receiver = Receiver(f"tcp://127.0.0.1:{port}", 1 << 30, ttl_s=60, security=SECURITY)
    security = (
        socket_security(b"another operator's KV secret 012")
        if stranger == "another secret"
        else PLAIN_SOCKETS
    )
    sender = PeerSender(context, f"tcp://127.0.0.1:{port}", timeout_s=0.5, security=security)
    try:
        [layer] = _layers(1)
        sender.send_layer("r", _header("t", 0, 1, layer), layer)
        # Refused in the handshake: the transfer fails by timeout, into the load-failure
        # policy, and the receiver never held (nor checked the MAC of) a byte of it.
        [(req_id, ok, _, _)] = _wait(sender.take_done)  # type: ignore[misc]
        assert (req_id, ok) == ("r", False)
        assert receiver.refused_connections >= 1
        assert receiver.take("t") is None
        assert receiver.auth_failures == 0 and receiver.buffered_bytes == 0
    finally:
        sender.close()
        receiver.close()
