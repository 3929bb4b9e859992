"""Multi-head Latent Attention over a paged latent cache, in PyTorch (CPU; runs on CUDA
tensors too).

The cache holds, per token and layer, one latent ``[c_kv (kv_lora_rank), k_pe
(qk_rope_head_dim)]``: shape ``[1, num_blocks, block_size, latent]`` (the leading 1
stands where K/V caches keep their 2, so code that indexes ``cache[:, block_ids]``, such
as the KV connectors, serves both). ``kv_b_proj`` maps ``c_kv`` to each head's key part
``W_UK [H, nope, kv_lora]`` and value ``W_UV [H, v, kv_lora]``.

* decode rows, absorbed: ``q_nope`` is pushed through ``W_UK`` once per step, so each
  head attends straight over the cached latents (an MQA with one shared key/value "head"
  of width ``latent`` / ``kv_lora``), and ``W_UV`` is applied to the attention output.
  Nothing per cached token is expanded.
* prefill chunks, expanded: the chunk's whole context is expanded to per-head keys and
  values (as HF computes it) and attended with a causal mask shifted by the cached
  prefix; a chunk has many queries, so expanding once is cheaper than absorbing.

The step's metadata is the CPU backend's (same builder): decode batch, prefill chunks,
slot mapping.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from kvserve.attention.backends.abstract import AttentionBackend, AttentionImpl
from kvserve.attention.backends.cpu_attn import (
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
    DecodeBatch,
    PrefillChunk,
)
from kvserve.transformers_utils.arch_families import MLAConfig


class MLALayer(Protocol):
    """What the impl needs from its layer: the up-projection of the latent."""

    def kv_b_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(``W_UK [H, nope, kv_lora]``, ``W_UV [H, v, kv_lora]``), views of kv_b_proj."""
        ...


class CPUMLAImpl(AttentionImpl):
    def __init__(self, num_heads: int, scale: float, mla: MLAConfig) -> None:
        super().__init__(num_heads, mla.latent_size, scale, 1)
        self.kv_lora_rank = mla.kv_lora_rank
        self.qk_nope_head_dim = mla.qk_nope_head_dim
        self.qk_rope_head_dim = mla.qk_rope_head_dim
        self.v_head_dim = mla.v_head_dim

    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: CPUAttentionMetadata,
    ) -> torch.Tensor:
        """``query [T, H, nope + rope]`` (rotated), ``key [T, 1, latent]`` (this step's
        latents, written to the cache), ``value`` unused; returns ``[T, H, v_head_dim]``."""
        md = attn_metadata
        n = md.num_actual_tokens
        cache = kv_cache[0].view(-1, self.head_size)  # [slots, latent]
        latents = key[:n, 0]
        if md.slot_token_indices is not None:
            latents = latents[md.slot_token_indices]
        cache.index_copy_(0, md.slot_mapping, latents.to(kv_cache.dtype))
        w_uk, w_uv = layer.kv_b_weights()  # type: ignore[operator]
        latent_cache = kv_cache[0]
        output = query.new_zeros(query.shape[0], self.num_heads, self.v_head_dim)
        if md.decode is not None:
            rows = md.decode.token_indices
            output[rows] = self._decode(query[rows], latent_cache, md.decode, w_uk, w_uv)
        for chunk in md.prefills:
            q = query[chunk.token_start : chunk.token_end]
            context = latent_cache[chunk.block_ids].reshape(-1, self.head_size)[: chunk.seq_len]
            mask = None if q.shape[0] == chunk.seq_len else chunk.causal_mask
            output[chunk.token_start : chunk.token_end] = self.expanded(
                q, context.to(q.dtype), mask, w_uk, w_uv
            )
        return output

    def _decode(
        self,
        query: torch.Tensor,
        latent_cache: torch.Tensor,
        d: DecodeBatch,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
    ) -> torch.Tensor:
        num_reqs = query.shape[0]
        q_nope, q_pe = query.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q_latent = torch.einsum("dhn,hnc->dhc", q_nope, w_uk)
        q_full = torch.cat((q_latent, q_pe), dim=-1).unsqueeze(2)  # [D, H, 1, latent]
        kv = latent_cache[d.block_table].reshape(num_reqs, 1, -1, self.head_size).to(query.dtype)
        out_latent = F.scaled_dot_product_attention(
            q_full,
            kv,
            kv[..., : self.kv_lora_rank],
            attn_mask=d.key_mask[:, None, None, :],
            scale=self.scale,
            enable_gqa=True,
        ).squeeze(2)  # [D, H, kv_lora]
        return torch.einsum("dhc,hvc->dhv", out_latent, w_uv)

    def expanded(
        self,
        query: torch.Tensor,
        context: torch.Tensor,
        mask: torch.Tensor | None,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
    ) -> torch.Tensor:
        """Attention of ``query [Lq, H, nope + rope]`` over latents ``context [L, latent]``
        expanded to per-head keys and values; ``mask [Lq, L]`` (None: causal)."""
        c_kv, k_pe = context.split([self.kv_lora_rank, self.head_size - self.kv_lora_rank], -1)
        k_nope = torch.einsum("lc,hnc->hln", c_kv, w_uk)  # [H, L, nope]
        v = torch.einsum("lc,hvc->hlv", c_kv, w_uv)  # [H, L, v]
        k = torch.cat((k_nope, k_pe.unsqueeze(0).expand(self.num_heads, -1, -1)), dim=-1)
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1).unsqueeze(0),
            k.unsqueeze(0),
            v.unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.scale,
        )
        return out.squeeze(0).transpose(0, 1)


class CPUMLABackend(AttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "CPU_MLA"

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        if num_kv_heads != 1:
            raise ValueError(f"an MLA cache holds one latent per token, not {num_kv_heads} heads")
        return (1, num_blocks, block_size, head_size)

    @staticmethod
    def get_builder_cls() -> type[CPUAttentionMetadataBuilder]:
        return CPUAttentionMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[CPUMLAImpl]:  # type: ignore[override]
        return CPUMLAImpl


__all__ = ["CPUMLABackend", "CPUMLAImpl", "MLALayer", "PrefillChunk"]
