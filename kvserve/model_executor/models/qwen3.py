"""Qwen3 and Qwen3-MoE: the Llama decoder with per-head RMS norms on queries and keys
(before RoPE); Qwen3-MoE swaps the MLP of its sparse layers for routed experts."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.model_executor.layers.layernorm import RMSNorm
from kvserve.model_executor.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
)
from kvserve.model_executor.models.moe_mlp import SparseMoeBlock
from kvserve.transformers_utils.arch_config import ArchConfig


class Qwen3Attention(LlamaAttention):
    def __init__(
        self, arch: ArchConfig, qkv_bias: bool, o_bias: bool, prefix: str, layer_idx: int
    ) -> None:
        super().__init__(arch, qkv_bias, o_bias, prefix, layer_idx)
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        q, k, v = self.qkv_proj.forward(hidden_states).split(self.qkv_split, dim=-1)
        # Contiguous inputs take the norm kernel at any number of rows (the fused decode
        # stack's arithmetic); contiguous outputs let the rotary kernel rotate in place.
        q = self.q_norm.forward(q.contiguous().view(num_tokens, -1, self.head_dim))
        k = self.k_norm.forward(k.contiguous().view(num_tokens, -1, self.head_dim))
        q, k = q.view(num_tokens, -1), k.view(num_tokens, -1)
        q, k = self.rotary_emb.forward(positions, q, k)
        return self.o_proj.forward(self.attn.forward(q, k, v))


class Qwen3DecoderLayer(LlamaDecoderLayer):
    def make_attention(
        self, arch: ArchConfig, qkv_bias: bool, o_bias: bool, prefix: str, layer_idx: int
    ) -> nn.Module:
        return Qwen3Attention(arch, qkv_bias, o_bias, prefix, layer_idx)

    def make_mlp(self, arch: ArchConfig, prefix: str, layer_idx: int) -> nn.Module:
        if arch.moe is not None and arch.moe.is_sparse_layer(layer_idx):
            return SparseMoeBlock(arch.moe, arch.hidden_size, prefix)
        return super().make_mlp(arch, prefix, layer_idx)


class Qwen3ForCausalLM(LlamaForCausalLM):
    supports_tensor_parallel = True  # Llama's layers with per-head q/k norms
    decoder_layer_cls = Qwen3DecoderLayer


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    supports_tensor_parallel = True  # experts split on their intermediate dim
