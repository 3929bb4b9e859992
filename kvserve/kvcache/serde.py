"""Serde: KV chunk tensors to bytes and back, with a self-describing header.

Every stored value is (ChunkMeta, payload). ChunkMeta names the serde, so a reader decodes
what a writer with a different serde stored.

- raw: the tensor's own bytes. Encoding a contiguous CPU tensor copies nothing; decoding is
  torch.frombuffer over the payload (no copy). The decoded tensor shares the payload's
  memory and must be treated as read-only.
- int8: symmetric per-token, per-head quantization. For KV shaped [..., tokens, heads,
  head_size] each head_size vector gets one float32 scale (absmax / 127). Payload is the
  int8 values then the float32 scales: 1 + 4/head_size bytes per element, about 3.8x smaller
  than float32 at head_size 64.
- zstd, int8-zstd, int4-zstd (kvserve.kvcache.zstd_serde): zstd-coded chunks, lossless or
  quantized per channel to 8 or 4 bits (each element within half a quantization step),
  for tiers where bytes cost more than CPU time. Their checksums (CRC32, zstd's) and an inner
  copy of the header make a damaged or misfiled value a ValueError even without a MAC.

A value that leaves the engine is sealed (seal_chunk): the payload followed by a MAC over
the chunk's key, its metadata and its bytes (kvserve.kvcache.integrity); open_chunk gives
the payload back, or None when the MAC fails. The plain authenticator adds nothing.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from kvserve.kvcache.config import SERDES
from kvserve.kvcache.integrity import KVAuthenticator
from kvserve.kvcache.zstd_serde import CODECS

Buffer = bytes | bytearray | memoryview

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported KV dtype {name!r}") from None


@dataclass(frozen=True)
class ChunkMeta:
    shape: tuple[int, ...]
    dtype: str
    serde: str

    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype, "serde": self.serde}

    @classmethod
    def from_dict(cls, data: Any) -> ChunkMeta:
        if not isinstance(data, dict):
            raise ValueError("chunk metadata must be a map")
        shape = data.get("shape")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise ValueError(f"bad chunk shape {shape!r}")
        dtype, serde = data.get("dtype"), data.get("serde")
        if not isinstance(dtype, str) or dtype not in _DTYPES:
            raise ValueError(f"bad chunk dtype {dtype!r}")
        if serde not in SERDES:
            raise ValueError(f"bad chunk serde {serde!r}")
        return cls(tuple(shape), dtype, serde)


def mac_header(meta: ChunkMeta) -> bytes:
    """The bytes of meta the MAC covers (shape, hence token count; dtype; serde)."""
    return msgspec.msgpack.encode(meta.to_dict())


def seal_chunk(auth: KVAuthenticator, key: str, meta: ChunkMeta, payload: Buffer) -> Buffer:
    return auth.seal(key, mac_header(meta), payload)


def open_chunk(
    auth: KVAuthenticator, key: str, meta: ChunkMeta, blob: Buffer, source: str
) -> Buffer | None:
    """The payload of a sealed value, or None (a miss) when it fails authentication."""
    return auth.open(key, mac_header(meta), blob, source)


def _frombuffer(payload: Buffer, dtype: torch.dtype, count: int, offset: int = 0) -> torch.Tensor:
    if count == 0:
        return torch.empty(0, dtype=dtype)
    with warnings.catch_warnings():
        # bytes from a socket or Redis are immutable; readers never write into them.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(payload, dtype=dtype, count=count, offset=offset)


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """A view of a contiguous CPU tensor's bytes (no copy)."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return flat.numpy().data


def _expected_len(meta: ChunkMeta) -> int:
    n = math.prod(meta.shape)
    if meta.serde == "raw":
        return n * dtype_from_name(meta.dtype).itemsize
    head_size = meta.shape[-1] if meta.shape else 1
    return n + (n // head_size if head_size else 0) * 4


def encode(kv: torch.Tensor, serde: str) -> tuple[ChunkMeta, Buffer]:
    kv = kv.detach().to("cpu")
    meta = ChunkMeta(tuple(kv.shape), dtype_name(kv.dtype), serde)
    if serde == "raw":
        return meta, _tensor_bytes(kv)
    if serde == "int8":
        x = kv.float()
        scale = (x.abs().amax(dim=-1, keepdim=True) / 127.0).clamp_min(1e-12)
        q = torch.round(x / scale).clamp_(-127, 127).to(torch.int8)
        payload = bytearray(_tensor_bytes(q))
        payload += _tensor_bytes(scale)
        return meta, payload
    codec = CODECS.get(serde)
    if codec is None:
        raise ValueError(f"unknown serde {serde!r}")
    return meta, codec.encode(kv, mac_header(meta))


def decode(meta: ChunkMeta, payload: Buffer) -> torch.Tensor:
    """The tensor back; raises ValueError when payload does not fit meta."""
    codec = CODECS.get(meta.serde)
    if codec is not None:
        return codec.decode(payload, mac_header(meta), meta.shape, dtype_from_name(meta.dtype))
    if len(payload) != _expected_len(meta):
        raise ValueError(f"payload is {len(payload)} bytes, {_expected_len(meta)} expected")
    dtype = dtype_from_name(meta.dtype)
    n = math.prod(meta.shape)
    if meta.serde == "raw":
        return _frombuffer(payload, dtype, n).view(meta.shape)
    q = _frombuffer(payload, torch.int8, n).view(meta.shape)
    scale = _frombuffer(payload, torch.float32, n // meta.shape[-1], offset=n)
    scale = scale.view(*meta.shape[:-1], 1)
    return (q.float() * scale).to(dtype)
