"""The KV cache spec of one attention layer, read from the layer's attention type, and
the zeroed memory the cache lives in."""

from __future__ import annotations

import dataclasses
import logging
import math

import torch

from kvserve.attention.cross_attention import CrossAttention
from kvserve.attention.layer import Attention
from kvserve.attention.mla import MLAAttention
from kvserve.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
from kvserve.protocol.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)
from kvserve.transformers_utils.mamba_arch import STATE_DTYPE_SIZE
from kvserve.utils.huge_pages import huge_page_zeros

logger = logging.getLogger(__name__)


def make_kv_cache_spec(
    layer: Attention, block_size: int, dtype_size: int, row_scale_bytes: int = 0
) -> KVCacheSpec:
    """MLA's latent; a decoder's cross-attention over its encoder output; else sliding window, chunked local, StreamingLLM sinks (a window
    plus sink tokens on a full-attention layer) or full attention, in that order.
    ``row_scale_bytes``: an int8 cache's scale after each (token, head) row."""
    if isinstance(layer, MLAAttention):
        return MLAAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=layer.head_size, dtype_size=dtype_size
        )
    common = {
        "block_size": block_size,
        "num_kv_heads": layer.num_kv_heads,
        "head_size": layer.head_size,
        "dtype_size": dtype_size,
        "row_scale_bytes": row_scale_bytes,
    }
    if isinstance(layer, CrossAttention):
        return CrossAttentionSpec(max_encoder_len=layer.max_encoder_len, **common)
    chunk = getattr(layer, "attention_chunk_size", None)
    num_sink_tokens = getattr(layer.impl, "num_sink_tokens", 0)
    if layer.sliding_window is not None and num_sink_tokens:
        return SinkFullAttentionSpec(
            sink_len=num_sink_tokens, sliding_window=layer.sliding_window, **common
        )
    if layer.sliding_window is not None:
        return SlidingWindowSpec(sliding_window=layer.sliding_window, **common)
    if chunk is not None:
        return ChunkedLocalAttentionSpec(attention_chunk_size=chunk, **common)
    return FullAttentionSpec(**common)


def enable_attention_sinks(layers: dict[str, Attention], sinks: int, window: int) -> None:
    """StreamingLLM: every full-attention layer sees the sink tokens plus a window (and
    so gets a SinkFullAttentionSpec)."""
    for layer in layers.values():
        if layer.sliding_window is not None or getattr(layer, "attention_chunk_size", None):
            continue  # already bounded: a model's own local layers keep their rule
        layer.sliding_window = window
        layer.impl.sliding_window = window
        layer.impl.num_sink_tokens = sinks
    logger.info("attention sinks: %d sink tokens + a window of %d tokens", sinks, window)


def zeroed_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on the CPU without writing it: fresh pages from the OS are zero (a
    1 GiB cache written by torch.zeros cost ~2 s of start-up), and on huge pages, which a
    decode step reading every request's keys and values streams faster (utils/huge_pages)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    return huge_page_zeros(nbytes).view(dtype).view(shape)


def make_mamba_spec(
    layer: MambaMixer2, block_size: int, page_size: int, prefix_caching: bool
) -> MambaSpec:
    """A Mamba layer's state block, padded to ``page_size`` (the attention layers' page)
    when that holds it, so the groups share tensors; else its own size."""
    spec = MambaSpec(
        block_size=block_size,
        conv_state_shape=layer.conv_state_shape,
        ssm_state_shape=layer.ssm_state_shape,
        dtype_size=STATE_DTYPE_SIZE,
        mamba_cache_mode="align" if prefix_caching else "none",
    )
    if page_size >= spec.state_bytes:
        return dataclasses.replace(spec, page_size_padded=page_size)
    return spec
