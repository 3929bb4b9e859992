"""The compressed serdes: KV chunks entropy-coded with zstd, lossless or quantized to 8 or 4
bits, for tiers where bytes cost more than CPU time (a remote store across a network).

- zstd: lossless. The chunk's bytes are byte-shuffled (byte i of every element together,
  as blosc does: float exponents then compress) and zstd-coded. Decodes bit-exact.
- int8-zstd, int4-zstd: asymmetric quantization to b = 8 or 4 bits with one float32
  minimum and one float32 step per channel over the chunk's tokens, then zstd. For KV
  shaped [layers, 2, tokens, heads, head_size] that is one (min, step) per layer, K or V,
  head and channel: q = round((x - min) / step), step = (max - min) / (2**b - 1), and the
  value decodes as min + q * step. 4-bit codes are packed two to a byte.

  Error bound: every decoded element is within step / 2 of the original (up to float32
  rounding, then the cast back to the chunk's dtype), step being that of its channel in
  that chunk. On SmolLM2-135M's KV (256-token chunks) that is a relative L2 error of about
  0.003 (K) and 0.005 (V) at 8 bits, 0.05 (K) and 0.08 (V) at 4 bits.

  Why per channel for V as well as K: keys have outlier channels (KIVI quantizes them per
  channel); values are commonly quantized per token, but on SmolLM2's KV per channel over a
  256-token chunk gives the smaller error (4-bit relative L2 0.084 against 0.10 per token
  and head) and the params cost 8 bytes per channel per chunk instead of 8 per head_size
  vector (6% of an int4 chunk instead of 25%). Chunks with few tokens pay relatively more
  for their params; the bound is the same.

A payload is one zstd frame (content size and XXH64 content checksum written) and a CRC32
of the frame's bytes (zstd's checksum covers the content but not the frame header, where a
flipped window-size bit would go unnoticed). The frame's content is MAGIC, the length of
the chunk's header, the header (the msgpack ChunkMeta bytes that the MAC also covers),
zero padding to 8 bytes, then the body (for the quantized serdes the float32 mins and
steps, then the codes). Without a MAC the decoder still refuses what it did not write: a
flipped bit or a cut anywhere (the CRC, then zstd's checksum), a frame whose declared size
differs from what the header implies or that would expand more than MAX_EXPANSION times
(both checked before decompressing, so a forged size allocates nothing), trailing bytes,
or a header other than the one the value is read under. Every failure is a ValueError, which
the tiers count as a miss.
"""

from __future__ import annotations

import math
import struct
import threading
import warnings
import zlib
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

Buffer = bytes | bytearray | memoryview

MAGIC = b"KVZ1"
# Level 1: on SmolLM2's shuffled KV, level 3 compressed no better (1.18x against 1.20x)
# and took twice as long to encode.
ZSTD_LEVEL = 1
# A frame may expand at most this much (plus MAX_EXPANSION_SLACK): real KV compresses
# 1.2x lossless and ~1.1x after quantization, while a forged frame of a few bytes can
# declare gigabytes. A legitimate chunk that compresses further (all zeros) is a miss.
MAX_EXPANSION = 64
MAX_EXPANSION_SLACK = 1 << 20
_LEN = struct.Struct("<I")
_CRC = struct.Struct("<I")
_PARAM_BYTES = 4  # float32 min and step

_contexts = threading.local()


def _compressor() -> zstandard.ZstdCompressor:
    # zstd contexts are not thread-safe; the disk writer and remote tiers run on threads.
    c: zstandard.ZstdCompressor | None = getattr(_contexts, "compressor", None)
    if c is None:
        c = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True, write_content_size=True)
        _contexts.compressor = c
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d: zstandard.ZstdDecompressor | None = getattr(_contexts, "decompressor", None)
    if d is None:
        d = zstandard.ZstdDecompressor()
        _contexts.decompressor = d
    return d


def _prefix(header: bytes) -> bytes:
    """MAGIC, header length, header, zeros to 8 bytes (so float32 params are aligned)."""
    prefix = MAGIC + _LEN.pack(len(header)) + header
    return prefix + bytes(-len(prefix) % 8)


def _view3(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(outer, tokens, inner): the token axis is third from last ([..., tokens, heads,
    head_size]); shorter shapes quantize along their first axis."""
    token_dim = max(len(shape) - 3, 0)
    tokens = shape[token_dim] if shape else 1
    return math.prod(shape[:token_dim]), tokens, math.prod(shape[token_dim + 1 :])


def _code_bytes(n: int, bits: int) -> int:
    # 4-bit codes are padded to a multiple of 8, so each half of them is whole int32 words.
    return n if bits == 8 else -(-n // 8) * 4


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8 < 16) two to a byte: byte i holds code i in its low nibble and
    code i + half in its high one. Halves, not neighbours, so that packing and unpacking
    are whole-word operations on int32 views (torch's uint8 shifts and interleaving
    copies are slow on CPU)."""
    padded = torch.zeros(-(-codes.numel() // 8) * 8, dtype=torch.uint8)
    padded[: codes.numel()] = codes
    low, high = padded.view(torch.int32).chunk(2)
    return (low | (high << 4)).view(torch.uint8)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    words = packed.view(torch.int32)
    out = torch.empty(2 * packed.numel(), dtype=torch.uint8)
    low, high = out.view(torch.int32).chunk(2)
    torch.bitwise_and(words, 0x0F0F0F0F, out=low)
    torch.bitwise_and(words >> 4, 0x0F0F0F0F, out=high)
    return out


def _frombuffer(buf: Buffer, dtype: torch.dtype, count: int, offset: int) -> torch.Tensor:
    if count == 0:
        return torch.empty(0, dtype=dtype)
    with warnings.catch_warnings():
        # zstd hands back immutable bytes; every use below reads them into a new tensor.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=dtype, count=count, offset=offset)


@dataclass(frozen=True)
class ZstdCodec:
    """One compressed serde. bits None is lossless zstd; 8 or 4 quantizes first."""

    bits: int | None

    def body_len(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        n = math.prod(shape)
        if self.bits is None:
            return n * dtype.itemsize
        outer, tokens, inner = _view3(shape)
        params = outer * inner if tokens else 0
        return _code_bytes(n, self.bits) + 2 * params * _PARAM_BYTES

    def encode(self, kv: torch.Tensor, header: bytes) -> bytes:
        body = self._lossless_body(kv) if self.bits is None else self._quantized_body(kv)
        prefix = _prefix(header)
        size = len(prefix) + sum(part.numel() for part in body)
        coder = _compressor().compressobj(size=size)
        out = [coder.compress(prefix)]
        out += [coder.compress(part.numpy().data) for part in body if part.numel()]
        out.append(coder.flush())
        frame = b"".join(out)
        return frame + _CRC.pack(zlib.crc32(frame))

    def decode(
        self, payload: Buffer, header: bytes, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        prefix = _prefix(header)
        offset = len(prefix)
        expected = offset + self.body_len(shape, dtype)
        view = memoryview(payload).cast("B")
        if len(view) < _CRC.size:
            raise ValueError(f"compressed chunk of {len(view)} bytes")
        frame = view[: -_CRC.size]
        if zlib.crc32(frame) != _CRC.unpack(view[-_CRC.size :])[0]:
            raise ValueError("compressed chunk fails its CRC32")
        try:
            # Checked before decompressing, so a forged size cannot make it allocate.
            declared = zstandard.frame_content_size(frame)
            if declared != expected:
                raise ValueError(f"zstd frame holds {declared} bytes, {expected} expected")
            if expected > MAX_EXPANSION * len(frame) + MAX_EXPANSION_SLACK:
                raise ValueError(f"a {len(frame)}-byte zstd frame claims {expected} bytes")
            content = _decompressor().decompress(frame, allow_extra_data=False)
        except zstandard.ZstdError as exc:
            raise ValueError(f"bad zstd frame: {exc}") from None
        if len(content) != expected:
            raise ValueError(f"zstd frame gave {len(content)} bytes, {expected} expected")
        if content[:offset] != prefix:
            raise ValueError("compressed chunk's inner header does not match its metadata")
        if self.bits is None:
            return self._lossless_tensor(content, offset, shape, dtype)
        return self._dequantize(content, offset, shape, dtype)

    # lossless

    @staticmethod
    def _lossless_body(kv: torch.Tensor) -> list[torch.Tensor]:
        # numpy transposes bytes several times faster than torch does on CPU.
        elements = kv.detach().contiguous().reshape(-1, 1).view(torch.uint8).numpy()
        return [torch.from_numpy(np.ascontiguousarray(elements.T))]

    @staticmethod
    def _lossless_tensor(
        content: bytes, offset: int, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        n = math.prod(shape)
        if n == 0:
            return torch.empty(shape, dtype=dtype)
        planes = _frombuffer(content, torch.uint8, n * dtype.itemsize, offset)
        elements = np.ascontiguousarray(planes.numpy().reshape(dtype.itemsize, n).T)
        return torch.from_numpy(elements.reshape(-1)).view(dtype).view(shape)

    # quantized

    def _quantized_body(self, kv: torch.Tensor) -> list[torch.Tensor]:
        assert self.bits is not None
        outer, tokens, inner = _view3(tuple(kv.shape))
        if kv.numel() == 0:
            return []
        x = kv.detach().float().reshape(outer, tokens, inner)
        lo = x.amin(dim=1, keepdim=True)
        step = (x.amax(dim=1, keepdim=True) - lo) / (2**self.bits - 1)
        # A constant channel has step 0 and x - lo == 0: any positive divisor gives code 0.
        q = torch.round((x - lo) / step.clamp_min(torch.finfo(torch.float32).tiny))
        codes = q.clamp_(0, 2**self.bits - 1).to(torch.uint8).reshape(-1)
        if self.bits == 4:
            codes = _pack_nibbles(codes)
        params = torch.cat([lo.reshape(-1), step.reshape(-1)])
        return [params.view(torch.uint8), codes]

    def _dequantize(
        self, content: bytes, offset: int, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        assert self.bits is not None
        n = math.prod(shape)
        if n == 0:
            return torch.empty(shape, dtype=dtype)
        outer, tokens, inner = _view3(shape)
        num_params = 2 * outer * inner
        params = _frombuffer(content, torch.float32, num_params, offset)
        codes = _frombuffer(
            content, torch.uint8, _code_bytes(n, self.bits), offset + num_params * _PARAM_BYTES
        )
        if self.bits == 4:
            codes = _unpack_nibbles(codes)[:n]
        lo, step = params.view(2, outer, 1, inner)
        x = torch.addcmul(lo, codes.view(outer, tokens, inner).float(), step)
        return x.to(dtype).view(shape)


CODECS: dict[str, ZstdCodec] = {
    "zstd": ZstdCodec(None),
    "int8-zstd": ZstdCodec(8),
    "int4-zstd": ZstdCodec(4),
}
