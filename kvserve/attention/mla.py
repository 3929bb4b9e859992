"""``MLAAttention``: the paged attention layer of Multi-head Latent Attention models
(DeepSeek-V2/V3). The model projects queries and the per-token latent; this layer
caches the latent (``MLAAttentionSpec``: one ``kv_lora_rank + qk_rope_head_dim`` vector
per token and layer) and attends through ``CPUMLABackend`` (absorbed weights for
decode rows, expanded keys and values for prefill chunks).
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.attention.backends.mla_cpu import CPUMLABackend, CPUMLAImpl
from kvserve.attention.layer import Attention
from kvserve.transformers_utils.arch_families import MLAConfig


class MLAAttention(Attention):
    def __init__(
        self, num_heads: int, scale: float, mla: MLAConfig, kv_b_proj: nn.Module, layer_name: str
    ) -> None:
        """``kv_b_proj``: the model's latent up-projection (weight ``[heads * (nope + v),
        kv_lora_rank]``), read at every step so loading and quantization see one copy."""
        super().__init__(num_heads, mla.latent_size, scale, 1, layer_name)
        self.backend = CPUMLABackend
        self.mla_impl = CPUMLAImpl(num_heads, scale, mla)
        self.impl = self.mla_impl
        self.kv_lora_rank = mla.kv_lora_rank
        self.qk_nope_head_dim = mla.qk_nope_head_dim
        self.v_head_dim = mla.v_head_dim
        # Not a submodule: the attention module owns kv_b_proj (and its checkpoint name).
        self._kv_b_proj = [kv_b_proj]
        self._dequantized_kv_b: torch.Tensor | None = None

    def kv_b_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        proj = self._kv_b_proj[0]
        weight: torch.Tensor = proj.weight  # type: ignore[assignment]
        quant = getattr(proj, "quant_weight", None)
        if weight.numel() == 0 and quant is not None:
            # --quantization dropped the float weight; the per-head einsums want one, so
            # the blocks are dequantized once (kv_b_proj is small: kv_lora_rank columns).
            if self._dequantized_kv_b is None:
                self._dequantized_kv_b = quant.dequantize()
            weight = self._dequantized_kv_b
        per_head = weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, -1)
        return per_head[:, : self.qk_nope_head_dim], per_head[:, self.qk_nope_head_dim :]

    def forward(  # type: ignore[override]
        self, query: torch.Tensor, latent: torch.Tensor
    ) -> torch.Tensor:
        """``query [T, H, nope + rope]`` (rope part rotated), ``latent [T, kv_lora_rank +
        rope]`` (``c_kv`` normed, ``k_pe`` rotated) -> ``[T, H * v_head_dim]``."""
        num_tokens = query.shape[0]
        out = self.run(query, latent.unsqueeze(1), latent.new_empty(0))
        return out.reshape(num_tokens, -1)

    def _causal_no_cache(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # Profiling run: the step's own latents, expanded, one causal sequence.
        w_uk, w_uv = self.kv_b_weights()
        return self.mla_impl.expanded(q, k[:, 0], None, w_uk, w_uv)

    def extra_repr(self) -> str:
        return (
            f"{self.layer_name}, heads={self.num_heads}, latent={self.head_size} "
            f"(kv_lora_rank={self.kv_lora_rank}), backend={self.backend.get_name()}"
        )
