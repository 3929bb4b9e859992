"""FalconH1 (HF ``FalconH1ForCausalLM``): every layer runs a Mamba-2 mixer and full
attention side by side on the same normed input and adds both to the residual, then a
gated MLP. The muP multipliers of its config scale linear maps, so they are folded into
those maps' weights at load time (zero cost per step); only the embedding's and the
logits' stay at run time, as a tied head shares their tensor."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from kvserve.model_executor.layers.layernorm import RMSNorm
from kvserve.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
from kvserve.model_executor.layers.vocab_parallel_embedding import (
    VocabParallelEmbedding,
)
from kvserve.model_executor.models.bamba import BambaAttention
from kvserve.model_executor.models.llama import LlamaForCausalLM, LlamaMLP
from kvserve.model_executor.models.mup_hybrid import MupHybridForCausalLM
from kvserve.model_executor.models.weight_utils import load_hf_weights
from kvserve.transformers_utils.arch_config import ArchConfig
from kvserve.transformers_utils.mamba_arch import MambaArch, MupMultipliers


class FalconH1DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, prefix: str) -> None:
        super().__init__()
        assert arch.mamba is not None
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mamba = MambaMixer2(arch.hidden_size, arch.mamba, layer_name=f"{prefix}.mamba")
        self.self_attn = BambaAttention(arch, f"{prefix}.self_attn", partial_rotary_factor=1.0)
        self.feed_forward = LlamaMLP(
            arch.hidden_size, arch.intermediate_size, prefix=f"{prefix}.feed_forward"
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        normed = self.input_layernorm.forward(hidden_states)
        mixed = self.mamba.forward(normed) + self.self_attn.forward(positions, normed)
        hidden_states = hidden_states + mixed
        return hidden_states + self.feed_forward.forward(
            self.pre_ff_layernorm.forward(hidden_states)
        )


class FalconH1Model(nn.Module):
    def __init__(self, arch: ArchConfig, mup: MupMultipliers, prefix: str) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            arch.vocab_size, arch.hidden_size, prefix=f"{prefix}.embed_tokens"
        )
        self.embedding_multiplier = mup.embedding
        self.layers = nn.ModuleList(
            FalconH1DecoderLayer(arch, prefix=f"{prefix}.layers.{i}")
            for i in range(arch.num_hidden_layers)
        )
        self.final_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens.forward(input_ids) * self.embedding_multiplier
        for layer in self.layers:
            hidden_states = layer.forward(positions, hidden_states)
        return self.final_layernorm.forward(hidden_states)


def _in_proj_scale(mamba: MambaArch, mup: MupMultipliers) -> torch.Tensor:
    """in_proj's output scales by part (HF's mup_vector): z, x, B, C, dt."""
    groups = mamba.n_groups * mamba.state_size
    sizes = (mamba.intermediate_size, mamba.intermediate_size, groups, groups, mamba.num_heads)
    return torch.cat([torch.full((n,), m) for n, m in zip(sizes, mup.ssm, strict=True)])


class FalconH1ForCausalLM(MupHybridForCausalLM):
    model_cls = FalconH1Model

    def _scaled(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` with the multipliers that scale its map folded in; a scale on a
        map's input scales its weight, not its bias."""
        mup, is_weight = self.mup, name.endswith(".weight")
        if ".mamba.in_proj." in name:
            assert self.arch.mamba is not None
            scale = _in_proj_scale(self.arch.mamba, mup)
            tensor = tensor * (scale[:, None] * mup.ssm_in if is_weight else scale)
        elif ".mamba.out_proj." in name:
            tensor = tensor * mup.ssm_out
        elif ".self_attn.o_proj." in name:
            tensor = tensor * mup.attention_out
        elif ".self_attn." in name:  # q, k, v: input scale; k's output scale too
            key = mup.key if ".k_proj." in name else 1.0
            tensor = tensor * (key * mup.attention_in if is_weight else key)
        elif ".feed_forward.gate_proj." in name:
            tensor = tensor * mup.mlp[0]
        elif ".feed_forward.down_proj." in name:
            tensor = tensor * mup.mlp[1]
        return tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def scaled() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                yield name, self._scaled(name, tensor)

        return load_hf_weights(
            self, scaled(), LlamaForCausalLM.stacked_params, self.arch.tie_word_embeddings
        )
