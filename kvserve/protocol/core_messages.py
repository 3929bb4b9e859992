"""What crosses the boundary between the front end and the engine-core process: the
messages on the two ZMQ sockets (msgpack, tagged unions) and the start-up handshake on
the spawn pipe. Both sides import this module; it needs neither torch nor the core."""

from __future__ import annotations

from typing import Any

import msgspec

from kvserve.protocol.engine_core import EngineCoreOutputs, EngineCoreRequest

# --- client -> core -------------------------------------------------------------------


class AddRequestMessage(msgspec.Struct, tag="add", array_like=True):
    request: EngineCoreRequest


class AbortRequestsMessage(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class UtilityCallMessage(msgspec.Struct, tag="utility", array_like=True):
    call_id: int
    method: str
    args: list[Any] = msgspec.field(default_factory=list)


InputMessage = AddRequestMessage | AbortRequestsMessage | UtilityCallMessage


# --- core -> client -------------------------------------------------------------------


class OutputsMessage(msgspec.Struct, tag="outputs", array_like=True):
    outputs: EngineCoreOutputs


class UtilityResultMessage(msgspec.Struct, tag="utility_result", array_like=True):
    call_id: int
    result: Any = None
    error: str | None = None


class EngineErrorMessage(msgspec.Struct, tag="engine_error", array_like=True):
    """Sent by the core just before it exits on an unexpected exception in its loop."""

    error: str


OutputMessage = OutputsMessage | UtilityResultMessage | EngineErrorMessage


# --- startup handshake (over the pipe) ------------------------------------------------


class ReadyMessage(msgspec.Struct, tag="ready", array_like=True):
    num_gpu_blocks: int
    block_size: int
    max_model_len: int


class StartupErrorMessage(msgspec.Struct, tag="startup_error", array_like=True):
    error_type: str
    error: str
    traceback: str = ""


HandshakeMessage = ReadyMessage | StartupErrorMessage
