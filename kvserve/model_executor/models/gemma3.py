"""Gemma 3 text decoder (``Gemma3ForCausalLM``; Gemma 3 270M / 1B, the text tower).

What differs from Llama: RMSNorm scales by ``1 + weight``; each layer normalises
queries and keys per head, and normalises the attention and MLP outputs before their
residual adds (four norms per layer); embeddings are multiplied by ``sqrt(hidden)`` in
the model dtype; the MLP is GELU(tanh)-gated; scores are scaled by
``query_pre_attn_scalar ** -0.5``. Layers alternate between sliding-window attention
(RoPE base ``rope_local_base_freq``) and global attention (``rope_theta`` and the
model's rope scaling), as ``ArchConfig.layer_types`` says; optional soft-caps apply to
attention scores and final logits.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from kvserve.attention.layer import Attention
from kvserve.model_executor.layers.activation import GeluAndMul
from kvserve.model_executor.layers.layernorm import GemmaRMSNorm
from kvserve.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from kvserve.model_executor.layers.rotary_embedding import get_rope
from kvserve.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from kvserve.model_executor.models.llama_decode_stack import LlamaDecodeStack
from kvserve.model_executor.models.weight_utils import load_hf_weights
from kvserve.transformers_utils.arch_config import ArchConfig


class Gemma3MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, prefix: str) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=False, prefix=f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=False, prefix=f"{prefix}.down_proj"
        )
        self.act_fn = GeluAndMul(approximate="tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(self.act_fn.forward(self.gate_up_proj.forward(x)))


class Gemma3Attention(nn.Module):
    def __init__(self, arch: ArchConfig, layer_idx: int, prefix: str) -> None:
        super().__init__()
        self.head_dim = arch.head_dim
        self.qkv_proj = QKVParallelLinear(
            arch.hidden_size,
            arch.head_dim,
            arch.num_attention_heads,
            arch.num_key_value_heads,
            bias=arch.attention_bias,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            arch.num_attention_heads * arch.head_dim,
            arch.hidden_size,
            bias=arch.attention_bias,
            prefix=f"{prefix}.o_proj",
        )
        self.q_norm = GemmaRMSNorm(arch.head_dim, arch.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(arch.head_dim, arch.rms_norm_eps)
        sliding_window = arch.layer_sliding_window(layer_idx)
        # HF scales only the global layers' frequencies (rope_scaling is theirs).
        self.rotary_emb = get_rope(
            arch.head_dim,
            arch.layer_rope_theta(layer_idx),
            None if sliding_window is not None else arch.rope_scaling,
            max_position=arch.max_position_embeddings,
        )
        scalar = arch.query_pre_attn_scalar or arch.head_dim
        self.attn = Attention(
            num_heads=self.qkv_proj.num_heads,
            head_size=arch.head_dim,
            scale=scalar**-0.5,
            num_kv_heads=self.qkv_proj.num_kv_heads,
            layer_name=f"{prefix}.attn",
            sliding_window=sliding_window,
            attention_chunk_size=arch.layer_chunk_size(layer_idx),
            logits_soft_cap=arch.attn_logit_softcapping,
        )
        self.qkv_split = [self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size]

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        qkv = self.qkv_proj.forward(hidden_states)
        q, k, v = qkv.split(self.qkv_split, dim=-1)
        # Per-head norms before RoPE; contiguous inputs take the norm kernel at any number
        # of rows (the fused decode stack's arithmetic), contiguous outputs let the rotary
        # kernel work in place.
        q = self.q_norm.forward(q.contiguous().view(num_tokens, -1, self.head_dim))
        k = self.k_norm.forward(k.contiguous().view(num_tokens, -1, self.head_dim))
        q, k = q.view(num_tokens, -1), k.view(num_tokens, -1)
        q, k = self.rotary_emb.forward(positions, q, k)
        return self.o_proj.forward(self.attn.forward(q, k, v))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, layer_idx: int, prefix: str) -> None:
        super().__init__()
        hidden, eps = arch.hidden_size, arch.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = Gemma3Attention(arch, layer_idx, prefix=f"{prefix}.self_attn")
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = Gemma3MLP(hidden, arch.intermediate_size, prefix=f"{prefix}.mlp")
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.self_attn.forward(
            positions, self.input_layernorm.forward(hidden_states)
        )
        hidden_states = residual + self.post_attention_layernorm.forward(hidden_states)
        residual = hidden_states
        hidden_states = self.mlp.forward(self.pre_feedforward_layernorm.forward(hidden_states))
        return residual + self.post_feedforward_layernorm.forward(hidden_states)


class Gemma3Model(nn.Module):
    embed_scale: torch.Tensor

    def __init__(self, arch: ArchConfig, prefix: str) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            arch.vocab_size, arch.hidden_size, prefix=f"{prefix}.embed_tokens"
        )
        # sqrt(hidden) rounded to the model dtype first, as HF multiplies it.
        scale = torch.tensor(arch.hidden_size**0.5).to(torch.get_default_dtype())
        self.register_buffer("embed_scale", scale, persistent=False)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(arch, i, prefix=f"{prefix}.layers.{i}")
            for i in range(arch.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps)
        # Decode steps as one C++ call (same kernels, same result); None: always the
        # modules (tests compare the two).
        self.decode_stack: LlamaDecodeStack | None = LlamaDecodeStack(list(self.layers), self.norm)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens.forward(input_ids) * self.embed_scale

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``inputs_embeds``: the step's embeddings (scaled text embeddings with image
        embeddings merged in, Gemma3ForConditionalGeneration) instead of ``input_ids``'."""
        hidden_states = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        stack = self.decode_stack
        stacked = stack.forward(hidden_states, positions) if stack is not None else None
        if stacked is not None:  # (the final norm of the residual stream, or the stream)
            assert stack is not None
            return stacked[0] if stack.applies_final_norm else self.norm.forward(stacked[0])
        for layer in self.layers:
            hidden_states = layer.forward(positions, hidden_states)
        return self.norm.forward(hidden_states)


class Gemma3ForCausalLM(nn.Module):
    # checkpoint sub-name -> (fused parameter sub-name, shard id)
    stacked_params: ClassVar[dict[str, tuple[str, str | int]]] = {
        ".q_proj.": (".qkv_proj.", "q"),
        ".k_proj.": (".qkv_proj.", "k"),
        ".v_proj.": (".qkv_proj.", "v"),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }

    def __init__(self, arch: ArchConfig, prefix: str = "") -> None:
        super().__init__()
        self.arch = arch
        self.model = Gemma3Model(arch, prefix=f"{prefix}.model" if prefix else "model")
        self.lm_head = ParallelLMHead(
            arch.vocab_size, arch.hidden_size, prefix=f"{prefix}.lm_head" if prefix else "lm_head"
        )
        if arch.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``input_ids``, ``positions``: ``[T]`` -> hidden states ``[T, hidden]``."""
        return self.model.forward(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, hidden] -> [N, vocab]`` float32, soft-capped where the config says."""
        logits = self.lm_head.compute_logits(hidden_states)
        cap = self.arch.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def greedy_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """``compute_logits(hidden_states).argmax(-1)``, or None (see ParallelLMHead).
        Not with a soft-cap: its tanh can round distinct logits to equal ones, which moves
        the first maximum."""
        if self.arch.final_logit_softcapping is not None:
            return None
        return self.lm_head.greedy_tokens(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_hf_weights(self, weights, self.stacked_params, self.arch.tie_word_embeddings)
