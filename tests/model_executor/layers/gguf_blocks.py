"""Block weights for the kernel tests: random ones quantized by the gguf package, and one
tensor of each type and shape from a packaged GGUF file."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from kvserve.config import ModelConfig
from kvserve.model_executor.layers.block_weight import BlockWeight

# GGUF's k-quants: 256 weights a super-block, (bytes, [(start, end) of its float16 scales]).
K_QUANTS = {T.Q4_K: (144, [(0, 2), (2, 4)]), T.Q6_K: (210, [(208, 210)])}


def random_blocks(qtype: T, rows: int, cols: int, seed: int) -> tuple[BlockWeight, torch.Tensor]:
    """A random weight's blocks and gguf's own float32 dequantization of them."""
    raw = random_raw(qtype, rows, cols, seed)
    reference = torch.from_numpy(dequantize(raw, qtype).astype(np.float32))
    return BlockWeight.from_raw(raw, qtype), reference


def random_raw(qtype: T, rows: int, cols: int, seed: int) -> np.ndarray:
    """A random weight in GGUF's bytes, ``[rows, row bytes]``. The gguf package cannot
    quantize k-quants: theirs are random bytes (every quant and 6-bit scale pattern) with
    finite float16 super-block scales of both signs, some zero, small enough that weights
    stay near the quantized ones' size (|w| < 1)."""
    rng = np.random.default_rng(seed)
    if qtype in K_QUANTS:
        nbytes, scale_bytes = K_QUANTS[qtype]
        raw = rng.integers(0, 256, (rows, cols // 256, nbytes), dtype=np.uint8)
        for start, end in scale_bytes:
            scale = (rng.standard_normal(raw.shape[:2]) * 2e-4).astype(np.float16)
            scale[rng.random(raw.shape[:2]) < 0.05] = 0
            raw[..., start:end] = scale[..., None].view(np.uint8)
        raw = raw.reshape(rows, -1)
    else:
        raw = quantize((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32), qtype)
    return raw


def packaged_tensors(
    model: str | None, types: tuple[T, ...]
) -> dict[tuple[T, tuple[int, int]], np.ndarray]:
    """One tensor of each of ``types`` and shape in the model's packaged GGUF file (not
    the 49k-row and larger heads)."""
    from kvserve.model_executor.model_loader.gguf_loader import iterate_gguf_blocks

    config = (
        ModelConfig(model=model, quantization="gguf") if model else ModelConfig(quantization="gguf")
    )
    assert config.resolved.path is not None
    found: dict[tuple[T, tuple[int, int]], np.ndarray] = {}
    for _, qtype, raw in iterate_gguf_blocks(config.resolved.path, config.arch):
        if qtype not in types or raw.shape[0] > 4096:
            continue
        found.setdefault((qtype, raw.shape), raw)
    return found


Check = Callable[[BlockWeight, torch.Tensor, torch.Tensor], None]


def check_packaged_tensors(
    model: str | None, types: tuple[T, ...], check: Check, rows: Iterable[int]
) -> None:
    """``check(weight, gguf's dequantization, x)`` on each packaged tensor of ``types`` (one
    per shape) for x of each row count."""
    tensors = packaged_tensors(model, types)
    assert tensors
    for (qtype, _), raw in tensors.items():
        weight = BlockWeight.from_raw(raw, qtype)
        reference = weight.dequantize()
        for count in rows:
            gen = torch.Generator().manual_seed(count)
            check(weight, reference, torch.randn(count, weight.shape[1], generator=gen))


def assert_rows_independent_of_threads(
    matmul: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tiles: Iterable[int]
) -> None:
    """A row's outputs are the same bits on 1 and 2 threads, and the first ``tiles`` rows
    alone give the whole batch's first rows."""
    threads = torch.get_num_threads()
    try:
        outs = []
        for count in (1, 2):
            torch.set_num_threads(count)
            batch = matmul(x)
            for rows in tiles:
                assert torch.equal(matmul(x[:rows]), batch[:rows])
            outs.append(batch)
        assert torch.equal(outs[0], outs[1])
    finally:
        torch.set_num_threads(threads)
