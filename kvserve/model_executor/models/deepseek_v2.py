"""DeepSeek-V2 / V3 style decoders: Multi-head Latent Attention plus mixture of experts
with shared experts (dense MLPs in the first ``first_k_dense_replace`` layers).

Attention (per token): queries come from ``q_proj`` (or the low-rank ``q_a_proj`` ->
norm -> ``q_b_proj``) as ``nope`` and ``rope`` parts per head; ``kv_a_proj_with_mqa``
gives the latent ``c_kv`` (normed by ``kv_a_layernorm``) and one rotated key ``k_pe``
shared by all heads. ``MLAAttention`` caches ``[c_kv, k_pe]`` and expands it through
``kv_b_proj``. RoPE (YaRN-scaled in the released models, its ``mscale`` also scaling
the softmax) rotates interleaved pairs in DeepSeek's checkpoints; the rope rows of the
projections are reordered evens-then-odds at load so kvserve's rotate-half RoPE applies
(the same reordering on queries and keys leaves every q.k product unchanged).

Routing: V2 scores with softmax (optionally group-limited), V3 with sigmoid plus a
correction bias and group-limited choice, both times ``routed_scaling_factor``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch
from torch import nn

from kvserve.attention.mla import MLAAttention
from kvserve.model_executor.layers.layernorm import RMSNorm
from kvserve.model_executor.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    divide,
    get_tp_rank_size,
)
from kvserve.model_executor.layers.rotary_embedding import get_rope, yarn_get_mscale
from kvserve.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from kvserve.model_executor.models.llama4 import interleaved_to_halves
from kvserve.model_executor.models.moe_mlp import SparseMoeBlock
from kvserve.transformers_utils.arch_config import ArchConfig


def mla_softmax_scale(arch: ArchConfig) -> float:
    assert arch.mla is not None
    scale = (arch.mla.qk_nope_head_dim + arch.mla.qk_rope_head_dim) ** -0.5
    rope = arch.rope_scaling or {}
    if rope.get("rope_type") == "yarn" and rope.get("mscale_all_dim"):
        mscale = yarn_get_mscale(float(rope["factor"]), float(rope["mscale_all_dim"]))
        scale *= mscale * mscale
    return scale


class DeepseekV2MLAAttention(nn.Module):
    def __init__(self, arch: ArchConfig, prefix: str) -> None:
        super().__init__()
        mla = arch.mla
        assert mla is not None, "DeepSeek's config describes its latent attention"
        self.mla = mla
        _, tp_size = get_tp_rank_size()
        total_heads = arch.num_attention_heads
        self.num_heads = divide(total_heads, tp_size)
        self.qk_head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        hidden, bias = arch.hidden_size, arch.attention_bias
        self.q_a_proj: ReplicatedLinear | None = None
        self.q_proj: ColumnParallelLinear | None = None
        if mla.q_lora_rank is not None:
            self.q_a_proj = ReplicatedLinear(hidden, mla.q_lora_rank, bias, f"{prefix}.q_a_proj")
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, arch.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(
                mla.q_lora_rank, total_heads * self.qk_head_dim, False, f"{prefix}.q_b_proj"
            )
        else:
            self.q_proj = ColumnParallelLinear(
                hidden, total_heads * self.qk_head_dim, False, f"{prefix}.q_proj"
            )
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            hidden, mla.latent_size, bias, f"{prefix}.kv_a_proj_with_mqa"
        )
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, arch.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(
            mla.kv_lora_rank,
            total_heads * (mla.qk_nope_head_dim + mla.v_head_dim),
            False,
            f"{prefix}.kv_b_proj",
        )
        self.o_proj = RowParallelLinear(
            total_heads * mla.v_head_dim, hidden, bias, f"{prefix}.o_proj"
        )
        self.rotary_emb = get_rope(
            mla.qk_rope_head_dim, arch.rope_theta, arch.rope_scaling,
            max_position=arch.max_position_embeddings,
        )  # fmt: skip
        self.attn = MLAAttention(
            self.num_heads, mla_softmax_scale(arch), mla, self.kv_b_proj, f"{prefix}.attn"
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        num_tokens, mla = hidden_states.shape[0], self.mla
        if self.q_a_proj is not None:
            q = self.q_b_proj.forward(
                self.q_a_layernorm.forward(self.q_a_proj.forward(hidden_states))
            )
        else:
            assert self.q_proj is not None
            q = self.q_proj.forward(hidden_states)
        q = q.view(num_tokens, self.num_heads, self.qk_head_dim)
        q_nope, q_pe = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa.forward(hidden_states).split(
            [mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1
        )
        c_kv = self.kv_a_layernorm.forward(c_kv.contiguous())
        # Contiguous copies: the rotary kernel rotates in place, row by row.
        q_pe, k_pe = self.rotary_emb.forward(
            positions, q_pe.reshape(num_tokens, -1).contiguous(), k_pe.contiguous()
        )
        query = torch.cat((q_nope, q_pe.view(num_tokens, self.num_heads, -1)), dim=-1)
        latent = torch.cat((c_kv, k_pe), dim=-1)
        return self.o_proj.forward(self.attn.forward(query, latent))


class DeepseekV2DecoderLayer(LlamaDecoderLayer):
    runs_in_decode_stack = False  # MLA attention, routed experts

    def make_attention(
        self, arch: ArchConfig, qkv_bias: bool, o_bias: bool, prefix: str, layer_idx: int
    ) -> nn.Module:
        return DeepseekV2MLAAttention(arch, prefix)

    def make_mlp(self, arch: ArchConfig, prefix: str, layer_idx: int) -> nn.Module:
        if arch.moe is not None and arch.moe.is_sparse_layer(layer_idx):
            return SparseMoeBlock(arch.moe, arch.hidden_size, prefix)
        return super().make_mlp(arch, prefix, layer_idx)


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    stacked_params: ClassVar[dict[str, tuple[str, str | int]]] = {
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }
    decoder_layer_cls = DeepseekV2DecoderLayer

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._rope_rows_as_halves(weights))

    def _rope_rows_as_halves(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        mla = self.arch.mla
        assert mla is not None
        heads = self.arch.num_attention_heads
        for name, tensor in weights:
            if _layer_index(name) >= self.arch.num_hidden_layers:
                continue  # V3's multi-token-prediction layers: not served
            if not mla.rope_interleave:
                yield name, tensor
            elif ".self_attn.q_proj." in name or ".self_attn.q_b_proj." in name:
                per_head = tensor.reshape(heads, -1, *tensor.shape[1:]).clone()
                rope = per_head[:, mla.qk_nope_head_dim :]
                flat = rope.reshape(-1, *tensor.shape[1:])
                per_head[:, mla.qk_nope_head_dim :] = interleaved_to_halves(flat, heads).view_as(
                    rope
                )
                yield name, per_head.reshape(tensor.shape)
            elif ".self_attn.kv_a_proj_with_mqa." in name:
                tensor = tensor.clone()
                tensor[mla.kv_lora_rank :] = interleaved_to_halves(tensor[mla.kv_lora_rank :], 1)
                yield name, tensor
            else:
                yield name, tensor


def _layer_index(name: str) -> int:
    """``model.layers.{i}.…`` -> ``i`` (-1 for weights outside the layers)."""
    parts = name.split(".")
    if len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit():
        return int(parts[2])
    return -1


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    pass
