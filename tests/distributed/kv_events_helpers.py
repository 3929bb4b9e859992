"""Helpers for tests that read a real KV events stream."""

from __future__ import annotations

import socket
import time

import msgspec
import zmq

from kvserve.distributed.kv_events_publisher import EventPublisher
from kvserve.protocol.kv_events import KVEventBatch
from kvserve.utils.kv_secret import read_kv_secret
from kvserve.utils.zmq_curve import socket_security

_decoder = msgspec.msgpack.Decoder(KVEventBatch)

# The session's KV secret (tests/conftest.py): engines started by tests publish over CURVE.
SECURITY = socket_security(read_kv_secret(None))

# The ts of the probe batches wait_subscribed publishes; tests skip them.
PROBE_TS = -1.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def recv_batch(sub: zmq.Socket[bytes], timeout: float = 5.0) -> tuple[bytes, int, KVEventBatch]:
    """(topic, seq, batch) of the next message; fails the test after timeout seconds."""
    if not sub.poll(int(timeout * 1000)):
        raise AssertionError(f"no KV events message within {timeout}s")
    topic, seq, payload = sub.recv_multipart()
    assert len(seq) == 8
    return topic, int.from_bytes(seq, "big"), _decoder.decode(payload)


def wait_subscribed(
    publisher: EventPublisher, sub: zmq.Socket[bytes], timeout: float = 10.0
) -> int:
    """Publishes empty probe batches until sub gets one (PUB drops messages sent before a
    subscription has arrived), drains the rest, and returns the last seq seen."""
    deadline = time.monotonic() + timeout
    while not sub.poll(20):
        assert time.monotonic() < deadline, "the subscriber never joined"
        publisher.publish(KVEventBatch(ts=PROBE_TS, events=[]))
    last = -1
    while sub.poll(100):
        _, last, batch = recv_batch(sub)
        assert batch.ts == PROBE_TS
    return last
