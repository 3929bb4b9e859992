"""Llama-family decoder (SmolLM2, TinyLlama, Llama 2/3), parameterised for relatives
such as Qwen2 that differ only in which projections carry a bias.

Inputs are the flattened tokens of every request in the step (no batch dim); the
paged ``Attention`` layer finds each request's context through the forward context.

The forwards call their submodules' ``forward`` directly rather than through
``nn.Module.__call__``: a decode step makes about 12 such calls per layer, and the hook
bookkeeping of ``__call__`` costs as much as the small ops themselves. Nothing registers
hooks on these modules.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from kvserve.attention.layer import Attention
from kvserve.distributed.parallel_state import get_pp_group, get_pp_layer_range
from kvserve.forward_context import current_token_selector
from kvserve.model_executor.layers.activation import SiluAndMul
from kvserve.model_executor.layers.layernorm import RMSNorm
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


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, prefix: str) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=False, prefix=f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=False, prefix=f"{prefix}.down_proj"
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(self.act_fn.forward(self.gate_up_proj.forward(x)))


class LlamaAttention(nn.Module):
    def __init__(
        self, arch: ArchConfig, qkv_bias: bool, o_bias: bool, prefix: str, layer_idx: int
    ) -> None:
        super().__init__()
        self.head_dim = arch.head_dim
        self.qkv_proj = QKVParallelLinear(
            arch.hidden_size,
            arch.head_dim,
            arch.num_attention_heads,
            arch.num_key_value_heads,
            bias=qkv_bias,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            arch.num_attention_heads * arch.head_dim,
            arch.hidden_size,
            bias=o_bias,
            prefix=f"{prefix}.o_proj",
        )
        self.rotary_emb = get_rope(
            arch.head_dim, arch.rope_theta, arch.rope_scaling,
            max_position=arch.max_position_embeddings,
        )  # fmt: skip
        # Local (per-TP-rank) head counts come from the sharded projection.
        self.attn = Attention(
            num_heads=self.qkv_proj.num_heads,
            head_size=arch.head_dim,
            scale=arch.head_dim**-0.5,
            num_kv_heads=self.qkv_proj.num_kv_heads,
            layer_name=f"{prefix}.attn",
            sliding_window=arch.layer_sliding_window(layer_idx),
            attention_chunk_size=arch.layer_chunk_size(layer_idx),
        )
        self.qkv_split = [self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size]

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj.forward(hidden_states)
        q, k, v = qkv.split(self.qkv_split, dim=-1)
        q, k = self.rotary_emb.forward(positions, q, k)
        return self.o_proj.forward(self.attn.forward(q, k, v))


class LlamaDecoderLayer(nn.Module):
    # Whether the fused decode stack (llama_decode_stack) computes this layer's forward:
    # Llama's parts, optionally per-head q/k norms (Qwen3). A family whose attention or
    # MLP is another computation (MLA, experts) says False.
    runs_in_decode_stack: ClassVar[bool] = True

    def __init__(
        self, arch: ArchConfig, qkv_bias: bool, o_bias: bool, prefix: str, layer_idx: int
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = self.make_attention(
            arch, qkv_bias, o_bias, f"{prefix}.self_attn", layer_idx
        )
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = self.make_mlp(arch, f"{prefix}.mlp", layer_idx)

    # Families that keep Llama's layer shape (Qwen3, Mixtral, DeepSeek) override these;
    # typed Any as the decode stack reads Llama's own modules (and runs only for those).
    def make_attention(
        self, arch: ArchConfig, qkv_bias: bool, o_bias: bool, prefix: str, layer_idx: int
    ) -> Any:
        return LlamaAttention(arch, qkv_bias, o_bias, prefix=prefix, layer_idx=layer_idx)

    def make_mlp(self, arch: ArchConfig, prefix: str, layer_idx: int) -> Any:
        return LlamaMLP(arch.hidden_size, arch.intermediate_size, prefix=prefix)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream is carried separately so each norm can fuse the add.
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm.forward(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm.forward(hidden_states, residual)
        hidden_states = self.self_attn.forward(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm.forward(hidden_states, residual)
        return self.mlp.forward(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        arch: ArchConfig,
        qkv_bias: bool,
        o_bias: bool,
        prefix: str,
        layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            arch.vocab_size, arch.hidden_size, prefix=f"{prefix}.embed_tokens"
        )
        # A pipeline stage builds only its own layers (all of them without PP).
        self.pp = get_pp_group()
        self.start_layer, self.end_layer = get_pp_layer_range(arch.num_hidden_layers)
        self.layers = nn.ModuleList(
            layer_cls(arch, qkv_bias, o_bias, prefix=f"{prefix}.layers.{i}", layer_idx=i)
            if self.start_layer <= i < self.end_layer
            else nn.Identity()
            for i in range(arch.num_hidden_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        # Decode steps as one C++ call (same kernels, same result); None: always the
        # modules (tests compare the two).
        self.decode_stack: LlamaDecodeStack | None = (
            LlamaDecodeStack(list(self.layers), self.norm)
            if layer_cls.runs_in_decode_stack and self.pp.world_size == 1
            else None
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.pp.world_size > 1:
            return self._forward_stage(input_ids, positions)
        hidden_states = self.embed_tokens.forward(input_ids)
        stack = self.decode_stack
        stacked = stack.forward(hidden_states, positions) if stack is not None else None
        if stacked is not None:  # (last MLP output or its final norm, residual)
            assert stack is not None
            if stack.applies_final_norm:
                return stacked[0]
            hidden_states, _ = self.norm.forward(*stacked)
            return hidden_states
        residual: torch.Tensor | None = None
        # CacheBlend: after the check layer only the selected tokens go on (a no-op
        # selector's check layer is -1, so a plain step never calls it).
        selector = current_token_selector()
        check_layer = selector.check_layer
        for index, layer in enumerate(self.layers):
            hidden_states, residual = layer.forward(positions, hidden_states, residual)
            if index == check_layer:
                hidden_states, residual, positions = selector.select(
                    hidden_states, residual, positions
                )
        hidden_states, _ = self.norm.forward(hidden_states, residual)
        return selector.restore(hidden_states)

    def _forward_stage(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One pipeline stage: the previous stage's hidden states and residual in, this
        stage's layers, the next stage's inputs out (the last stage returns the normed
        states; the others their own output, which only keeps shapes for the runner)."""
        pp = self.pp
        residual: torch.Tensor | None = None
        if pp.is_first_rank:
            hidden_states = self.embed_tokens.forward(input_ids)
        else:
            received = pp.recv_tensor_dict()
            hidden_states, residual = received["hidden_states"], received.get("residual")
        for layer in self.layers[self.start_layer : self.end_layer]:
            hidden_states, residual = layer.forward(positions, hidden_states, residual)
        if not pp.is_last_rank:
            sent = {"hidden_states": hidden_states}
            if residual is not None:
                sent["residual"] = residual
            pp.send_tensor_dict(sent)
            return hidden_states
        hidden_states, _ = self.norm.forward(hidden_states, residual)
        return hidden_states


_LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")


def _layer_index(name: str) -> int | None:
    match = _LAYER_INDEX.search(name)
    return int(match.group(1)) if match else None


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class LlamaForCausalLM(nn.Module):
    # checkpoint sub-name -> (fused parameter sub-name, shard id)
    stacked_params: ClassVar[dict[str, tuple[str, str | int]]] = {
        ".q_proj.": (".qkv_proj.", "q"),
        ".k_proj.": (".qkv_proj.", "k"),
        ".v_proj.": (".qkv_proj.", "v"),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }
    decoder_layer_cls: ClassVar[type[LlamaDecoderLayer]] = LlamaDecoderLayer
    # Read from each class's own body: a subclass with other layers must opt in itself.
    supports_tensor_parallel: ClassVar[bool] = True
    supports_pipeline_parallel: ClassVar[bool] = True

    @staticmethod
    def attention_biases(arch: ArchConfig) -> tuple[bool, bool]:
        """(qkv_proj has bias, o_proj has bias); HF Llama's `attention_bias` covers both."""
        return arch.attention_bias, arch.attention_bias

    def __init__(self, arch: ArchConfig, prefix: str = "") -> None:
        super().__init__()
        self.arch = arch
        qkv_bias, o_bias = self.attention_biases(arch)
        self.model = LlamaModel(
            arch, qkv_bias, o_bias, _join(prefix, "model"), self.decoder_layer_cls
        )
        self.lm_head = ParallelLMHead(
            arch.vocab_size, arch.hidden_size, prefix=_join(prefix, "lm_head")
        )
        if arch.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``input_ids``, ``positions``: ``[T]`` -> hidden states ``[T, hidden]``."""
        return self.model.forward(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, hidden] -> [N, vocab]`` float32."""
        return self.lm_head.compute_logits(hidden_states)

    def greedy_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """``compute_logits(hidden_states).argmax(-1)``, or None (see ParallelLMHead)."""
        return self.lm_head.greedy_tokens(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; returns the parameter names that were filled and
        raises if any parameter was left unset."""
        model = self.model
        local = range(model.start_layer, model.end_layer)
        if len(local) < self.arch.num_hidden_layers:  # other pipeline stages' layers
            weights = ((n, w) for n, w in weights if _layer_index(n) in (None, *local))
        return load_hf_weights(self, weights, self.stacked_params, self.arch.tie_word_embeddings)
