"""The KV cache spec of one attention layer, read from the layer's attention type."""

from __future__ import annotations

from kvserve.attention.layer import Attention
from kvserve.protocol.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)


def make_kv_cache_spec(layer: Attention, block_size: int, dtype_size: int) -> KVCacheSpec:
    """Sliding window, chunked local, StreamingLLM sinks (a window plus sink tokens on a
    full-attention layer) or full attention, in that order of precedence."""
    common = {
        "block_size": block_size,
        "num_kv_heads": layer.num_kv_heads,
        "head_size": layer.head_size,
        "dtype_size": dtype_size,
    }
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
