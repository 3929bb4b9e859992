from __future__ import annotations

import pytest
import torch

from kvserve.kvcache import serde


def test_raw_round_trip_without_copy() -> None:
    kv = torch.randn(4, 2, 16, 3, 64)
    meta, payload = serde.encode(kv, "raw")
    assert len(payload) == kv.numel() * 4
    # Encoding a contiguous tensor is a view of its memory ...
    assert memoryview(payload).obj is not None
    out = serde.decode(meta, payload)
    assert torch.equal(out, kv)
    # ... and decoding is a view of the payload.
    buf = bytearray(payload)
    view = serde.decode(meta, buf)
    buf[0:4] = b"\x00\x00\x00\x00"
    assert view.flatten()[0].item() == 0.0


def test_int8_round_trip_error_bound_and_size() -> None:
    torch.manual_seed(0)
    kv = torch.randn(30, 2, 256, 3, 64) * torch.rand(30, 2, 256, 3, 1) * 8
    meta, payload = serde.encode(kv, "int8")
    ratio = kv.numel() * 4 / len(payload)
    assert 3.7 < ratio <= 4.0
    out = serde.decode(meta, payload)
    assert out.dtype == torch.float32 and out.shape == kv.shape
    # Per-token, per-head scales: each element is within half a quantization step.
    step = kv.abs().amax(dim=-1, keepdim=True) / 127
    assert torch.all((out - kv).abs() <= step / 2 + 1e-6)
    rel = (out - kv).norm() / kv.norm()
    assert rel < 0.01


def test_decode_rejects_mismatched_payload() -> None:
    meta, payload = serde.encode(torch.ones(2, 2, 4, 1, 8), "raw")
    with pytest.raises(ValueError):
        serde.decode(meta, bytes(payload)[:-1])
    with pytest.raises(ValueError):
        serde.ChunkMeta.from_dict({"shape": [1, "x"], "dtype": "float32", "serde": "raw"})
    with pytest.raises(ValueError):
        serde.ChunkMeta.from_dict({"shape": [1], "dtype": "object", "serde": "raw"})
