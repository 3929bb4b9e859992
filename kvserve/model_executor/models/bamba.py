"""Bamba (HF ``BambaForCausalLM``): a Mamba-2 / attention hybrid. Layers listed in
``attn_layer_indices`` are attention with half the head rotated (HF hard-codes
``partial_rotary_factor=0.5``), the others Mamba-2 mixers; every layer has a gated MLP."""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from kvserve.attention.layer import Attention
from kvserve.model_executor.layers.layernorm import RMSNorm
from kvserve.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from kvserve.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
from kvserve.model_executor.layers.rotary_embedding import get_rope
from kvserve.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from kvserve.model_executor.models.llama import LlamaForCausalLM, LlamaMLP
from kvserve.model_executor.models.weight_utils import load_hf_weights
from kvserve.transformers_utils.arch_config import ArchConfig
from kvserve.transformers_utils.mamba_arch import MAMBA

_PARTIAL_ROTARY_FACTOR = 0.5


class NoRotary(nn.Module):
    """Attention without positions (NemotronH: the Mamba layers carry the order)."""

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k


class BambaAttention(nn.Module):
    """The hybrids' attention: RoPE on the first ``partial_rotary_factor`` of each head
    (none at 0); scores scaled by ``scale`` (default ``1/sqrt(head_dim)``)."""

    def __init__(
        self,
        arch: ArchConfig,
        prefix: str,
        partial_rotary_factor: float = _PARTIAL_ROTARY_FACTOR,
        scale: float | None = None,
    ) -> None:
        super().__init__()
        head_dim = arch.head_dim
        self.qkv_proj = QKVParallelLinear(
            arch.hidden_size, head_dim, arch.num_attention_heads, arch.num_key_value_heads,
            bias=arch.attention_bias, prefix=f"{prefix}.qkv_proj",
        )  # fmt: skip
        self.o_proj = RowParallelLinear(
            arch.num_attention_heads * head_dim, arch.hidden_size,
            bias=arch.attention_bias, prefix=f"{prefix}.o_proj",
        )  # fmt: skip
        rotary_dim = int(head_dim * partial_rotary_factor)
        self.rotary_emb: nn.Module = NoRotary()
        if rotary_dim:
            self.rotary_emb = get_rope(
                head_dim, arch.rope_theta, arch.rope_scaling, rotary_dim=rotary_dim,
                max_position=arch.max_position_embeddings,
            )  # fmt: skip
        self.attn = Attention(
            num_heads=self.qkv_proj.num_heads,
            head_size=head_dim,
            scale=head_dim**-0.5 if scale is None else scale,
            num_kv_heads=self.qkv_proj.num_kv_heads,
            layer_name=f"{prefix}.attn",
        )
        self.qkv_split = [self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size]

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.forward(hidden_states).split(self.qkv_split, dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj.forward(self.attn.forward(q, k, v))


class BambaDecoderLayer(nn.Module):
    """Mixer (Mamba or attention) then MLP, each with a pre-norm and a residual."""

    def __init__(self, arch: ArchConfig, layer_idx: int, prefix: str) -> None:
        super().__init__()
        assert arch.mamba is not None
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.is_mamba = arch.layer_types[layer_idx] == MAMBA
        # Only one of the two exists per layer (the checkpoint's names).
        if self.is_mamba:
            self.mamba = MambaMixer2(arch.hidden_size, arch.mamba, layer_name=f"{prefix}.mamba")
        else:
            self.self_attn = BambaAttention(arch, prefix=f"{prefix}.self_attn")
        self.feed_forward = LlamaMLP(
            arch.hidden_size, arch.intermediate_size, prefix=f"{prefix}.feed_forward"
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        normed = self.input_layernorm.forward(hidden_states)
        if self.is_mamba:
            mixed = self.mamba.forward(normed)
        else:
            mixed = self.self_attn.forward(positions, normed)
        hidden_states = hidden_states + mixed
        return hidden_states + self.feed_forward.forward(
            self.pre_ff_layernorm.forward(hidden_states)
        )


class BambaModel(nn.Module):
    def __init__(self, arch: ArchConfig, prefix: str) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            arch.vocab_size, arch.hidden_size, prefix=f"{prefix}.embed_tokens"
        )
        self.layers = nn.ModuleList(
            BambaDecoderLayer(arch, i, prefix=f"{prefix}.layers.{i}")
            for i in range(arch.num_hidden_layers)
        )
        self.final_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens.forward(input_ids)
        for layer in self.layers:
            hidden_states = layer.forward(positions, hidden_states)
        return self.final_layernorm.forward(hidden_states)


class BambaForCausalLM(nn.Module):
    supports_tensor_parallel: ClassVar[bool] = False
    supports_pipeline_parallel: ClassVar[bool] = False

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        if arch.mamba is None:
            raise ValueError("BambaForCausalLM needs the config's Mamba fields")
        self.arch = arch
        self.model = BambaModel(arch, prefix="model")
        self.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size, prefix="lm_head")
        if arch.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model.forward(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_hf_weights(
            self, weights, LlamaForCausalLM.stacked_params, self.arch.tie_word_embeddings
        )
