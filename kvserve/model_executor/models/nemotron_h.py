"""NemotronH (HF ``NemotronHForCausalLM``): a hybrid whose every layer is one pre-normed
residual block of a single kind, from the config's pattern (``hybrid_override_pattern``
"M-M*-...", or ``layers_block_type``): a Mamba-2 mixer (M), attention without positions
(*), or a squared-ReLU MLP (-). Routed-expert layers (E) are refused by the config
reader (mamba_arch.py)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model_executor.layers.layernorm import RMSNorm
from kvserve.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from kvserve.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
from kvserve.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from kvserve.model_executor.models.bamba import BambaAttention
from kvserve.model_executor.models.weight_utils import load_hf_weights
from kvserve.transformers_utils.arch_config import ArchConfig
from kvserve.transformers_utils.mamba_arch import MAMBA, MLP

# The attention's q/k/v go into one fused projection; the MLP's up_proj stays itself
# (there is no gate to fuse it with).
_STACKED_PARAMS: dict[str, tuple[str, str | int]] = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
}


class NemotronHMLP(nn.Module):
    """``down(relu(up(x))^2)``: HF's ``relu2`` MLP, no gate."""

    def __init__(self, arch: ArchConfig, prefix: str) -> None:
        super().__init__()
        self.up_proj = ColumnParallelLinear(
            arch.hidden_size, arch.intermediate_size, bias=False, prefix=f"{prefix}.up_proj"
        )
        self.down_proj = RowParallelLinear(
            arch.intermediate_size, arch.hidden_size, bias=False, prefix=f"{prefix}.down_proj"
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(torch.square(F.relu(self.up_proj.forward(x))))


class NemotronHBlock(nn.Module):
    """``x + mixer(norm(x))``; the mixer is the checkpoint's ``mixer`` whatever its kind."""

    def __init__(self, arch: ArchConfig, layer_idx: int, prefix: str) -> None:
        super().__init__()
        assert arch.mamba is not None
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.is_mamba = arch.layer_types[layer_idx] == MAMBA
        self.mixer: nn.Module
        if self.is_mamba:
            self.mixer = MambaMixer2(arch.hidden_size, arch.mamba, layer_name=f"{prefix}.mixer")
        elif arch.layer_types[layer_idx] == MLP:
            self.mixer = NemotronHMLP(arch, prefix=f"{prefix}.mixer")
        else:
            self.mixer = BambaAttention(arch, f"{prefix}.mixer", partial_rotary_factor=0.0)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        normed = self.norm.forward(hidden_states)
        if self.is_mamba:  # the recurrent state carries the order
            return hidden_states + self.mixer(normed)
        return hidden_states + self.mixer(positions, normed)


class NemotronHModel(nn.Module):
    def __init__(self, arch: ArchConfig, prefix: str) -> None:
        super().__init__()
        self.embeddings = VocabParallelEmbedding(
            arch.vocab_size, arch.hidden_size, prefix=f"{prefix}.embeddings"
        )
        self.layers = nn.ModuleList(
            NemotronHBlock(arch, i, prefix=f"{prefix}.layers.{i}")
            for i in range(arch.num_hidden_layers)
        )
        self.norm_f = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embeddings.forward(input_ids)
        for layer in self.layers:
            hidden_states = layer.forward(positions, hidden_states)
        return self.norm_f.forward(hidden_states)


class NemotronHForCausalLM(nn.Module):
    supports_tensor_parallel: ClassVar[bool] = False
    supports_pipeline_parallel: ClassVar[bool] = False

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        if arch.mamba is None:
            raise ValueError("NemotronHForCausalLM needs the config's Mamba fields")
        self.arch = arch
        self.model = NemotronHModel(arch, prefix="model")
        self.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size, prefix="lm_head")
        if arch.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embeddings)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model.forward(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # NVIDIA's own checkpoints name the trunk "backbone" (HF's loader renames it).
        renamed = ((n.replace("backbone.", "model.", 1), w) for n, w in weights)
        return load_hf_weights(self, renamed, _STACKED_PARAMS, self.arch.tie_word_embeddings)
