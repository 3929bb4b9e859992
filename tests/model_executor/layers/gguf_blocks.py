"""Block weights for the kernel tests: random ones quantized by the gguf package, and one
tensor of each type and shape from a packaged GGUF file."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from kvserve.config import ModelConfig
from kvserve.model_executor.layers.quantization import BlockWeight


def random_blocks(qtype: T, rows: int, cols: int, seed: int) -> tuple[BlockWeight, torch.Tensor]:
    """A random weight's blocks and gguf's own float32 dequantization of them."""
    rng = np.random.default_rng(seed)
    raw = quantize((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32), qtype)
    reference = torch.from_numpy(dequantize(raw, qtype).astype(np.float32))
    return BlockWeight.from_raw(raw, qtype), reference


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
