"""The wire format between an executor and its worker processes: msgpack, typed.

Messages are msgspec Structs and dataclasses (SchedulerOutput, ModelRunnerOutput,
KVCacheConfig...), decoded against their declared types, so nothing arrives as an
untyped object and nothing is unpickled. Tensors and numpy arrays travel as msgpack
extensions: a small msgpack header (dtype name, shape) followed by the raw bytes.

A call's arguments are encoded one by one and decoded on the worker against the
annotations of the function that takes them (``rpc_arg_types``); its result against the
function's return annotation. That is what lets ``collective_rpc`` carry any method of
the worker, or any importable ``module:function``, without a per-method message type.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import typing
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import torch

from kvserve.protocol.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)
from kvserve.protocol.scheduler_output import KVConnectorMetadata, SchedulerOutput
from kvserve.worker.worker import Worker

_EXT_NDARRAY = 1
_EXT_TENSOR = 2


class ArrayHeader(msgspec.Struct, array_like=True):
    dtype: str
    shape: list[int]


_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(ArrayHeader)


def _pack(array: np.ndarray) -> bytes:
    if array.dtype.hasobject:  # its bytes would be this process's pointers
        raise TypeError("object arrays do not cross processes")
    header = _header_encoder.encode(ArrayHeader(array.dtype.str, list(array.shape)))
    return len(header).to_bytes(4, "little") + header + np.ascontiguousarray(array).tobytes()


def _unpack(data: memoryview) -> np.ndarray:
    size = int.from_bytes(data[:4], "little")
    header = _header_decoder.decode(data[4 : 4 + size])
    dtype = np.dtype(header.dtype)
    if dtype.hasobject:
        raise ValueError("object arrays do not cross processes")
    return np.frombuffer(data[4 + size :], dtype=dtype).reshape(header.shape).copy()


def enc_hook(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu()
        if t.dtype == torch.bfloat16:  # numpy has no bfloat16: move its bits as int16
            return msgspec.msgpack.Ext(_EXT_TENSOR, b"b" + _pack(t.view(torch.int16).numpy()))
        return msgspec.msgpack.Ext(_EXT_TENSOR, b"n" + _pack(t.numpy()))
    if isinstance(obj, np.ndarray):
        return msgspec.msgpack.Ext(_EXT_NDARRAY, _pack(obj))
    if isinstance(obj, np.generic):
        return obj.item()
    raise NotImplementedError(f"{type(obj).__name__} has no kvserve wire encoding")


def ext_hook(code: int, data: memoryview) -> Any:
    if code == _EXT_NDARRAY:
        return _unpack(data)
    if code == _EXT_TENSOR:
        tensor = torch.from_numpy(_unpack(data[1:]))
        return tensor.view(torch.bfloat16) if bytes(data[:1]) == b"b" else tensor
    raise ValueError(f"unknown msgpack extension {code}")


def dec_hook(typ: type, obj: Any) -> Any:
    if isinstance(typ, type) and issubclass(typ, KVConnectorMetadata) and isinstance(obj, list):
        return _metadata_from_frame(typ, obj)
    # Tensors and arrays were rebuilt by ext_hook already; anything else is refused.
    if isinstance(obj, typ):
        return obj
    raise TypeError(f"expected {getattr(typ, '__name__', typ)}, got {type(obj).__name__}")


# ---- KV connector metadata: each connector's own dataclass, named on the wire ------------


class ConnectorMetadataFrame(msgspec.Struct, array_like=True):
    """A KVConnectorMetadata subclass ("module:QualName") and its fields; nested metadata
    (MultiConnector's children) are frames too."""

    cls: str
    fields: dict[str, Any]


def _to_frame(value: Any) -> Any:
    if isinstance(value, KVConnectorMetadata):
        if not dataclasses.is_dataclass(value):
            raise TypeError(f"{type(value).__name__} must be a dataclass to cross processes")
        cls = type(value)
        return ConnectorMetadataFrame(
            f"{cls.__module__}:{cls.__qualname__}",
            {f.name: _to_frame(getattr(value, f.name)) for f in dataclasses.fields(value)},
        )
    if isinstance(value, list | tuple) and any(isinstance(v, KVConnectorMetadata) for v in value):
        return [_to_frame(v) for v in value]
    return value


def _metadata_from_frame(expected: type, frame: list[Any]) -> KVConnectorMetadata:
    path, fields = frame
    cls = resolve_function(path) if isinstance(path, str) else None
    if not (isinstance(cls, type) and issubclass(cls, expected) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"{path!r} is not a {expected.__name__} dataclass")
    return typing.cast("KVConnectorMetadata", msgspec.convert(fields, cls, dec_hook=dec_hook))


def _for_wire(obj: Any) -> Any:
    """The metadata a SchedulerOutput carries, as a frame (a copy: the engine's own
    object is left alone)."""
    if isinstance(obj, SchedulerOutput) and obj.kv_connector_metadata is not None:
        return dataclasses.replace(obj, kv_connector_metadata=_to_frame(obj.kv_connector_metadata))
    return obj


encoder = msgspec.msgpack.Encoder(enc_hook=enc_hook)


def encode(obj: Any) -> bytes:
    return encoder.encode(_for_wire(obj))


def decode(data: bytes | memoryview, typ: Any = Any) -> Any:
    return msgspec.msgpack.decode(data, type=typ, dec_hook=dec_hook, ext_hook=ext_hook)


# ---- KV cache specs: a subclass per attention type, named on the wire ---------------------

# msgspec decodes a dataclass field as the declared class: a SlidingWindowSpec declared as
# KVCacheSpec would arrive as a plain FullAttentionSpec. Specs travel with their kind.
SPEC_KINDS: dict[str, type[FullAttentionSpec]] = {
    cls.kind: cls
    for cls in (
        FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec,
        SinkFullAttentionSpec, MLAAttentionSpec, MambaSpec,
    )
}  # fmt: skip


class SpecFrame(msgspec.Struct, array_like=True):
    kind: str
    fields: dict[str, Any]


def spec_to_frame(spec: KVCacheSpec) -> SpecFrame:
    return SpecFrame(spec.kind, dataclasses.asdict(spec))


def spec_from_frame(frame: SpecFrame) -> KVCacheSpec:
    if frame.kind not in SPEC_KINDS:
        raise ValueError(f"unknown KV cache spec kind {frame.kind!r}")
    return msgspec.convert(frame.fields, SPEC_KINDS[frame.kind])


class KVCacheConfigFrame(msgspec.Struct, array_like=True):
    num_blocks: int
    groups: list[tuple[list[str], SpecFrame]]
    tensors: list[list[str]]

    @classmethod
    def of(cls, config: KVCacheConfig) -> KVCacheConfigFrame:
        return cls(
            config.num_blocks,
            [(g.layer_names, spec_to_frame(g.kv_cache_spec)) for g in config.kv_cache_groups],
            [t.shared_by for t in config.kv_cache_tensors],
        )

    def config(self) -> KVCacheConfig:
        return KVCacheConfig(
            self.num_blocks,
            [KVCacheGroupSpec(names, spec_from_frame(spec)) for names, spec in self.groups],
            [KVCacheTensor(shared_by) for shared_by in self.tensors],
        )


def kv_cache_spec_frames(worker: Worker) -> dict[str, SpecFrame]:
    """Worker side of Executor.get_kv_cache_specs across processes."""
    return {name: spec_to_frame(spec) for name, spec in worker.get_kv_cache_spec().items()}


def initialize_from_config_frame(worker: Worker, frame: KVCacheConfigFrame) -> None:
    """Worker side of Executor.initialize_from_config across processes."""
    worker.initialize_from_config(frame.config())


# ---- what an RPC carries ------------------------------------------------------------------


def resolve_function(method: str) -> Callable[..., Any]:
    """``module:function``: a function taking the worker as its first argument."""
    module_name, _, name = method.partition(":")
    if not module_name or not name:
        raise ValueError(f"{method!r} is neither a worker method nor a 'module:function' path")
    target: Any = importlib.import_module(module_name)
    for part in name.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise TypeError(f"{method!r} is not callable")
    return typing.cast("Callable[..., Any]", target)


def rpc_target(method: str, worker: Worker | None = None) -> Callable[..., Any]:
    """The function a call names, unbound (the worker is its first argument)."""
    if ":" in method:
        return resolve_function(method)
    fn = getattr(type(worker) if worker is not None else Worker, method, None)
    if fn is None or method.startswith("_") or not callable(fn):
        raise AttributeError(f"the worker has no method {method!r}")
    return typing.cast("Callable[..., Any]", fn)


def _hints(fn: Callable[..., Any]) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn)
    except (NameError, TypeError):  # annotations that do not resolve: decode untyped
        return {}


def rpc_arg_types(
    fn: Callable[..., Any], nargs: int, kwargs: list[str]
) -> tuple[list[Any], dict[str, Any]]:
    """The declared types of ``nargs`` positional arguments (after the worker) and of the
    named ones; ``Any`` where a parameter is not annotated."""
    hints = _hints(fn)
    params = [
        p
        for p in inspect.signature(fn).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ][1:]
    positional = [hints.get(p.name, Any) for p in params[:nargs]]
    positional += [Any] * (nargs - len(positional))
    return positional, {k: hints.get(k, Any) for k in kwargs}


def rpc_return_type(fn: Callable[..., Any]) -> Any:
    return _hints(fn).get("return", Any)


class RPCRequest(msgspec.Struct, array_like=True, tag="call"):
    call_id: int
    method: str  # a Worker method name or an importable "module:function"
    args: list[msgspec.Raw]
    kwargs: dict[str, msgspec.Raw]
    reply_rank: int | None = None  # None: every rank replies


class RPCShutdown(msgspec.Struct, array_like=True, tag="shutdown"):
    pass


NO_RESULT = msgspec.Raw(msgspec.msgpack.encode(None))


class RPCReply(msgspec.Struct, array_like=True):
    call_id: int
    rank: int
    # The encoded result; None from a rank that was not asked for it.
    result: msgspec.Raw = msgspec.field(default_factory=lambda: NO_RESULT)
    has_result: bool = False
    error: str | None = None


WorkerInput = RPCRequest | RPCShutdown


class ReadyMessage(msgspec.Struct, array_like=True):
    """A worker's handshake: ready, or the exception its start-up raised."""

    rank: int
    error_type: str | None = None
    error: str | None = None
