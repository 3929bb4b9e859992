"""The cache server's wire format, shared by the server and CacheServerBackend.

A frame, each way:

    header length (u32, big-endian) | msgpack header (a map) | payload (header["len"] bytes)

Requests: {"op": "PUT", "key": str, "meta": map, "len": n} + payload; {"op": "GET", "key"};
{"op": "EXISTS", "key"}; {"op": "DELETE", "key"}; {"op": "HEALTH"}; {"op": "AUTH", "token"},
the first request of a connection to a server that has a token (any other is refused and
the connection closed).
Replies: {"status": "ok" | "miss" | "error", ...}; a GET hit carries "meta" and a payload.
Header and payload lengths are capped; a frame over a cap is an error and ends the connection.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

import msgspec

LENGTH = struct.Struct(">I")
MAX_HEADER_BYTES = 1 << 16
OPS = ("PUT", "GET", "EXISTS", "DELETE", "HEALTH", "AUTH")


class ProtocolError(ValueError):
    """A frame the peer sent breaks the protocol."""


def encode_frame(header: dict[str, Any], payload_len: int = 0) -> bytes:
    raw = msgspec.msgpack.encode({**header, "len": payload_len})
    return LENGTH.pack(len(raw)) + raw


def decode_header(raw: bytes) -> dict[str, Any]:
    try:
        header = msgspec.msgpack.decode(raw)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"header is not msgpack: {exc}") from exc
    if not isinstance(header, dict):
        raise ProtocolError("header is not a map")
    length = header.get("len", 0)
    if not isinstance(length, int) or isinstance(length, bool) or length < 0:
        raise ProtocolError(f"bad payload length {length!r}")
    header["len"] = length
    return header


def _recv_exactly(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("cache server closed the connection")
        got += k
    return buf


def send_request(
    sock: socket.socket, header: dict[str, Any], payload: bytes | bytearray | memoryview = b""
) -> None:
    frame = encode_frame(header, len(payload))
    if len(payload) < (1 << 16):
        sock.sendall(frame + bytes(payload))
    else:
        sock.sendall(frame)
        sock.sendall(payload)


def recv_reply(sock: socket.socket, max_payload: int) -> tuple[dict[str, Any], bytearray]:
    (header_len,) = LENGTH.unpack(_recv_exactly(sock, LENGTH.size))
    if header_len > MAX_HEADER_BYTES:
        raise ProtocolError(f"reply header of {header_len} bytes")
    header = decode_header(bytes(_recv_exactly(sock, header_len)))
    if header["len"] > max_payload:
        raise ProtocolError(f"reply payload of {header['len']} bytes")
    payload = _recv_exactly(sock, header["len"]) if header["len"] else bytearray()
    return header, payload
