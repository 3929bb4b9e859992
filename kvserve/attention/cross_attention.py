"""``CrossAttention``: the decoder layer of an encoder-decoder model (Whisper) that
attends to its request's encoder output, kept in the cross-attention KV cache group
(``CrossAttentionSpec``; backends/cross_attn.py has the math)."""

from __future__ import annotations

import torch

from kvserve.attention.backends.cross_attn import CrossAttentionBackend, CrossAttentionImpl
from kvserve.attention.layer import Attention
from kvserve.forward_context import get_forward_context


class CrossAttention(Attention):
    """Non-causal attention of decoder queries over ``max_encoder_len`` encoder K/V,
    without rotary embeddings. ``forward(query, key, value)`` takes the encoder's K/V of
    the requests that start in this step (None when none does): they are written into the
    cache once and read by every later step."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        layer_name: str,
        max_encoder_len: int,
    ) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, layer_name)
        self.max_encoder_len = max_encoder_len
        self.backend = CrossAttentionBackend
        impl = CrossAttentionImpl(num_heads, head_size, scale, num_kv_heads)
        impl.causal = False
        impl.max_encoder_len = max_encoder_len
        self.impl = impl

    def forward(  # type: ignore[override]
        self, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None
    ) -> torch.Tensor:
        num_tokens = query.shape[0]
        q = query.view(num_tokens, self.num_heads, self.head_size)
        k = None if key is None else key.view(-1, self.num_kv_heads, self.head_size)
        v = None if value is None else value.view(-1, self.num_kv_heads, self.head_size)
        attn_metadata = get_forward_context().attn_metadata
        if isinstance(attn_metadata, dict):
            attn_metadata = attn_metadata[self.layer_name]
        if attn_metadata is None:
            # Profiling run without a KV cache: attend to the given encoder K/V, if any.
            if k is None or v is None:
                return torch.zeros_like(query)
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale=self.scale
            )
            return out.transpose(0, 1).reshape(num_tokens, -1)
        if self.kv_cache.numel() == 0:
            raise RuntimeError(f"{self.layer_name}: KV cache not bound (bind_kv_cache)")
        impl = self.impl
        assert isinstance(impl, CrossAttentionImpl)
        out = impl.forward(self, q, k, v, self.kv_cache, attn_metadata)
        return out.reshape(num_tokens, -1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, cross, max_encoder_len={self.max_encoder_len}"
