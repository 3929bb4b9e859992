"""Reading a KV events stream: live batches from the PUB socket, missed ones by replay.

The counterpart of kv_events_publisher (see its docstring for the wire format). With the
publisher's KV secret both sockets are CURVE clients; with another one (or none) the
publisher refuses them and nothing arrives.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
import zmq

from kvserve.distributed.kv_events_publisher import END_SEQ, decode_seq, encode_seq
from kvserve.protocol.kv_events import KVCacheEvent, KVEventBatch
from kvserve.utils.zmq_curve import PLAIN_SOCKETS, SocketSecurity

_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def decode_batch(payload: bytes) -> KVEventBatch:
    return _decoder.decode(payload)


def event_to_dict(event: KVCacheEvent) -> dict[str, Any]:
    """A JSON-ready dict: {"type": "BlockStored", ...}, block hashes as hex strings."""
    out: dict[str, Any] = {"type": type(event).__name__}
    for name in event.__struct_fields__:
        out[name] = _hexify(getattr(event, name))
    return out


def _hexify(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list):
        return [_hexify(v) for v in value]
    return value


class KVEventSubscriber:
    """A SUB socket on the publisher, plus an optional DEALER for replay requests.

    Connect before the batches you want are published: PUB drops what no subscriber
    was connected for (ask the replay socket for those).
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        security: SocketSecurity = PLAIN_SOCKETS,
    ) -> None:
        self._security = security
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        security.curve_client(self._sub)
        self._sub.connect(endpoint)
        self._replay: zmq.Socket[bytes] | None = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.DEALER)
            security.curve_client(self._replay)
            self._replay.connect(replay_endpoint)

    def recv(self, timeout: float | None = None) -> tuple[int, KVEventBatch] | None:
        """The next live (seq, batch), or None when nothing came within timeout seconds."""
        if not self._sub.poll(None if timeout is None else int(timeout * 1000)):
            return None
        _topic, seq, payload = self._sub.recv_multipart()
        return decode_seq(seq), decode_batch(payload)

    def replay(self, start_seq: int, timeout: float = 5.0) -> Iterator[tuple[int, KVEventBatch]]:
        """Every buffered batch with seq >= start_seq, oldest first, up to the end marker."""
        if self._replay is None:
            raise RuntimeError("no replay endpoint was given")
        self._replay.send_multipart((b"", encode_seq(start_seq)))
        while True:
            if not self._replay.poll(int(timeout * 1000)):
                raise TimeoutError(f"no replay answer within {timeout}s")
            _empty, seq, payload = self._replay.recv_multipart()
            if seq == END_SEQ:
                return
            yield decode_seq(seq), decode_batch(payload)

    def close(self) -> None:
        self._sub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._security.term(self._ctx)

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
