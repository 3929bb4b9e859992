"""BERT encoder (HF ``BertModel``) for embeddings: bidirectional attention, post-norm
layers, absolute position and token-type embeddings; no LM head.

Runs only under the pooling runner. Its ``Attention`` layers are ``encoder_only``: every
token of a prompt sees all the others, so the engine computes each prompt whole in one
step and never reuses its KV (prefix caching and chunked prefill are off for encoders,
see ``EngineConfig._configure_pooling``); the cache blocks live only as long as the
request. Inputs are the flattened tokens of the step, as for the decoders.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.attention.layer import Attention
from kvserve.model_executor.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from kvserve.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from kvserve.model_executor.models.weight_utils import load_hf_weights
from kvserve.transformers_utils.arch_config import ArchConfig


class BertEmbeddings(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size)
        self.position_embeddings = nn.Embedding(arch.max_position_embeddings, arch.hidden_size)
        self.token_type_embeddings = nn.Embedding(max(arch.type_vocab_size, 1), arch.hidden_size)
        self.LayerNorm = nn.LayerNorm(arch.hidden_size, eps=arch.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # Single-segment inputs: every token is of type 0, as sentence encoders use them.
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        return self.LayerNorm(x + self.token_type_embeddings.weight[0])


class BertLayer(nn.Module):
    def __init__(self, arch: ArchConfig, prefix: str) -> None:
        super().__init__()
        hidden, heads = arch.hidden_size, arch.num_attention_heads
        self.qkv_proj = QKVParallelLinear(hidden, arch.head_dim, heads, heads, bias=True)
        self.attn = Attention(
            num_heads=self.qkv_proj.num_heads,
            head_size=arch.head_dim,
            scale=arch.head_dim**-0.5,
            num_kv_heads=self.qkv_proj.num_kv_heads,
            layer_name=f"{prefix}.attn",
            attn_type="encoder_only",
        )
        self.attn_out = RowParallelLinear(hidden, hidden, bias=True)
        self.attn_norm = nn.LayerNorm(hidden, eps=arch.rms_norm_eps)
        self.intermediate = ColumnParallelLinear(hidden, arch.intermediate_size, bias=True)
        self.output = RowParallelLinear(arch.intermediate_size, hidden, bias=True)
        self.output_norm = nn.LayerNorm(hidden, eps=arch.rms_norm_eps)
        self.split = [self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        x = self.attn_norm(x + self.attn_out(self.attn(q, k, v)))
        return self.output_norm(x + self.output(F.gelu(self.intermediate(x))))


class BertModel(nn.Module):
    # HF's module names -> this model's (stacked q/k/v; renamed sublayers).
    stacked_params: ClassVar[dict[str, tuple[str, str | int]]] = {
        ".attention.self.query.": (".qkv_proj.", "q"),
        ".attention.self.key.": (".qkv_proj.", "k"),
        ".attention.self.value.": (".qkv_proj.", "v"),
    }
    _renames: ClassVar[tuple[tuple[str, str], ...]] = (
        (".attention.output.dense.", ".attn_out."),
        (".attention.output.LayerNorm.", ".attn_norm."),
        (".intermediate.dense.", ".intermediate."),
        (".output.dense.", ".output."),
        (".output.LayerNorm.", ".output_norm."),
    )

    def __init__(self, arch: ArchConfig, prefix: str = "") -> None:
        super().__init__()
        self.arch = arch
        self.embeddings = BertEmbeddings(arch)
        self.layers = nn.ModuleList(
            BertLayer(arch, prefix=f"encoder.layer.{i}") for i in range(arch.num_hidden_layers)
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``input_ids``, ``positions``: ``[T]`` -> final hidden states ``[T, hidden]``."""
        x = self.embeddings(input_ids, positions)
        for layer in self.layers:
            x = layer(x)
        return x

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_hf_weights(self, self._hf_to_local(weights), self.stacked_params, False)

    def _hf_to_local(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            name = name.removeprefix("bert.").removeprefix("model.")
            if name.startswith(("pooler.", "cls.")) or name.endswith("position_ids"):
                continue  # the [CLS] classifier head and MLM head: not part of embeddings
            if name.startswith("encoder.layer."):
                name = name.replace("encoder.layer.", "layers.", 1)
                for hf, local in self._renames:  # the attention's own names come first
                    if hf in name:
                        name = name.replace(hf, local)
                        break
            yield name, tensor
