"""Pure Mamba-2 (HF ``Mamba2ForCausalLM``): every layer a Mamba-2 mixer, no attention,
so a request's whole context is one state block per layer."""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from kvserve.model_executor.layers.layernorm import RMSNorm
from kvserve.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
from kvserve.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from kvserve.model_executor.models.weight_utils import load_hf_weights
from kvserve.transformers_utils.arch_config import ArchConfig


class Mamba2Block(nn.Module):
    def __init__(self, arch: ArchConfig, prefix: str) -> None:
        super().__init__()
        assert arch.mamba is not None
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mixer = MambaMixer2(arch.hidden_size, arch.mamba, layer_name=f"{prefix}.mixer")

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states + self.mixer.forward(self.norm.forward(hidden_states))


class Mamba2Model(nn.Module):
    def __init__(self, arch: ArchConfig, prefix: str) -> None:
        super().__init__()
        self.embeddings = VocabParallelEmbedding(
            arch.vocab_size, arch.hidden_size, prefix=f"{prefix}.embeddings"
        )
        self.layers = nn.ModuleList(
            Mamba2Block(arch, prefix=f"{prefix}.layers.{i}") for i in range(arch.num_hidden_layers)
        )
        self.norm_f = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embeddings.forward(input_ids)
        for layer in self.layers:
            hidden_states = layer.forward(hidden_states)
        return self.norm_f.forward(hidden_states)


class Mamba2ForCausalLM(nn.Module):
    supports_tensor_parallel: ClassVar[bool] = False
    supports_pipeline_parallel: ClassVar[bool] = False

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        if arch.mamba is None:
            raise ValueError("Mamba2ForCausalLM needs the config's Mamba fields")
        self.arch = arch
        self.backbone = Mamba2Model(arch, prefix="backbone")
        self.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size, prefix="lm_head")
        if arch.tie_word_embeddings:
            self.lm_head.tie_weights(self.backbone.embeddings)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``positions`` are unused: the recurrent state carries the order."""
        return self.backbone.forward(input_ids)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # Old checkpoints name the embedding "embedding" (HF's load hook renames it).
        renamed = (
            (n.replace("backbone.embedding.", "backbone.embeddings."), w) for n, w in weights
        )
        return load_hf_weights(self, renamed, {}, self.arch.tie_word_embeddings)
