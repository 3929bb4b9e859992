"""The kv_transfer_params of P2pZmqConnector: what a proxy puts in the prefill and the
decode request, and what the producer answers with.

Prefill request (to a kv_producer), named by the proxy:
    {"do_remote_decode": true, "remote_host": "10.0.0.2", "remote_port": 14579,
     "transfer_id": "<id>"}    # optional: a prefix of the transfer's id, unique per request
Producer's answer (the prefill response's kv_transfer_params), given as is to a consumer:
    {"do_remote_prefill": true, "transfer_id": ..., "num_tokens": 52,
     "prompt_hash": "<sha256 of the first num_tokens prompt ids>", "kv_bytes": 1597440,
     "remote_engine_id": <producer engine id>, "remote_host": ..., "remote_port": ...,
     "tp_size": <producer's tensor_parallel_size>}
Decode request (to a kv_consumer): the answer above. The consumer loads num_tokens tokens
of KV (the prompt but its last token, whose logits the consumer computes) and checks
prompt_hash against the request's own prompt so that KV never lands under other tokens.

Under tensor parallelism each producer rank r sends its own KV heads to the consumer's
rank r, which listens at remote_port + r; both sides must have the same TP size (a
consumer refuses KV whose tp_size differs from its own, naming the field). A missing
tp_size means 1.

Pure Python: the scheduler side parses these.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any

MAX_ID_CHARS = 1024


def prompt_hash(token_ids: list[int]) -> str:
    """sha256 over the token ids (64-bit little endian): equal on both sides of a transfer."""
    return hashlib.sha256(struct.pack(f"<{len(token_ids)}q", *token_ids)).hexdigest()


def _field(params: dict[str, Any], name: str, kind: type, required: bool = True) -> Any:
    value = params.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        what = {int: "an integer", str: "a string"}.get(kind, kind.__name__)
        raise ValueError(f"kv_transfer_params.{name} must be {what}, got {value!r}")
    if isinstance(value, str) and not 0 < len(value) <= MAX_ID_CHARS:
        raise ValueError(f"kv_transfer_params.{name} must be 1 to {MAX_ID_CHARS} characters")
    return value


def _port(params: dict[str, Any]) -> int:
    port = _field(params, "remote_port", int)
    if not 0 < port < 65536:
        raise ValueError(f"kv_transfer_params.remote_port must be in 1..65535, got {port}")
    return int(port)


@dataclass(frozen=True)
class SendParams:
    """A prefill whose KV goes to the consumer at remote_host:remote_port."""

    remote_host: str
    remote_port: int
    transfer_id: str | None

    @property
    def address(self) -> str:
        return f"tcp://{self.remote_host}:{self.remote_port}"


@dataclass(frozen=True)
class RecvParams:
    """A decode whose KV (num_tokens tokens) arrives under transfer_id."""

    transfer_id: str
    num_tokens: int
    prompt_hash: str
    tp_size: int = 1  # the producer's: each of its ranks sent its own KV heads


def parse_send(params: dict[str, Any] | None) -> SendParams | None:
    """SendParams for a do_remote_decode request, None for any other; ValueError names
    the bad field."""
    if not params or not params.get("do_remote_decode"):
        return None
    return SendParams(
        remote_host=_field(params, "remote_host", str),
        remote_port=_port(params),
        transfer_id=_field(params, "transfer_id", str, required=False),
    )


def parse_recv(params: dict[str, Any] | None) -> RecvParams | None:
    """RecvParams for a do_remote_prefill request, None for any other."""
    if not params or not params.get("do_remote_prefill"):
        return None
    num_tokens = _field(params, "num_tokens", int)
    if num_tokens < 0:
        raise ValueError(f"kv_transfer_params.num_tokens must be >= 0, got {num_tokens}")
    tp_size = _field(params, "tp_size", int, required=False)
    if tp_size is not None and tp_size < 1:
        raise ValueError(f"kv_transfer_params.tp_size must be >= 1, got {tp_size}")
    return RecvParams(
        transfer_id=_field(params, "transfer_id", str),
        num_tokens=num_tokens,
        prompt_hash=_field(params, "prompt_hash", str),
        tp_size=1 if tp_size is None else int(tp_size),
    )


def check_params(params: dict[str, Any] | None) -> None:
    """Raises ValueError for malformed P2P params (the front end's 400)."""
    if params is None:
        return
    if not isinstance(params, dict):
        raise ValueError("kv_transfer_params must be an object")
    parse_send(params)
    parse_recv(params)
