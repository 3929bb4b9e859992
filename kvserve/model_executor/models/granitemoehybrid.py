"""GraniteMoeHybrid (HF ``GraniteMoeHybridForCausalLM``, Granite 4.0-H): Bamba's layout
(each layer a Mamba-2 mixer or attention, from ``layer_types``) with Granite's MLP:
routed experts plus a shared gated MLP every token takes (or only the shared one when
``num_local_experts`` is 0), and Granite's scalars. The residual multiplier scales each
block's output, so it is folded into the output projections at load; the embedding and
logits scalars stay at run time (a tied head shares their tensor)."""

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
from kvserve.model_executor.models.moe_mlp import SparseMoeBlock
from kvserve.model_executor.models.mup_hybrid import MupHybridForCausalLM
from kvserve.model_executor.models.weight_utils import load_hf_weights
from kvserve.transformers_utils.arch_config import ArchConfig
from kvserve.transformers_utils.mamba_arch import MAMBA, MupMultipliers


class GraniteMoeHybridDecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, mup: MupMultipliers, layer_idx: int, prefix: str) -> None:
        super().__init__()
        assert arch.mamba is not None
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.is_mamba = arch.layer_types[layer_idx] == MAMBA
        # Only one of the two exists per layer (the checkpoint's names).
        if self.is_mamba:
            self.mamba = MambaMixer2(arch.hidden_size, arch.mamba, layer_name=f"{prefix}.mamba")
        else:
            self.self_attn = BambaAttention(
                arch, f"{prefix}.self_attn", partial_rotary_factor=0.0 if arch.no_rope else 1.0,
                scale=mup.attention_scale,
            )  # fmt: skip
        self.shared_mlp = LlamaMLP(
            arch.hidden_size, arch.intermediate_size, prefix=f"{prefix}.shared_mlp"
        )
        self.block_sparse_moe: SparseMoeBlock | None = None
        if arch.moe is not None:
            self.block_sparse_moe = SparseMoeBlock(
                arch.moe, arch.hidden_size, prefix=f"{prefix}.block_sparse_moe"
            )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        normed = self.input_layernorm.forward(hidden_states)
        if self.is_mamba:
            mixed = self.mamba.forward(normed)
        else:
            mixed = self.self_attn.forward(positions, normed)
        hidden_states = hidden_states + mixed
        normed = self.post_attention_layernorm.forward(hidden_states)
        mlp = self.shared_mlp.forward(normed)
        if self.block_sparse_moe is not None:
            mlp = mlp + self.block_sparse_moe.forward(normed)
        return hidden_states + mlp


class GraniteMoeHybridModel(nn.Module):
    def __init__(self, arch: ArchConfig, mup: MupMultipliers, prefix: str) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            arch.vocab_size, arch.hidden_size, prefix=f"{prefix}.embed_tokens"
        )
        self.embedding_multiplier = mup.embedding
        self.layers = nn.ModuleList(
            GraniteMoeHybridDecoderLayer(arch, mup, i, prefix=f"{prefix}.layers.{i}")
            for i in range(arch.num_hidden_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens.forward(input_ids) * self.embedding_multiplier
        for layer in self.layers:
            hidden_states = layer.forward(positions, hidden_states)
        return self.norm.forward(hidden_states)


# Output projections the residual multiplier scales (weights and biases alike).
_RESIDUAL_OUTPUTS = (
    ".self_attn.o_proj.", ".mamba.out_proj.", ".shared_mlp.down_proj.", ".experts.w2.",
)  # fmt: skip


class GraniteMoeHybridForCausalLM(MupHybridForCausalLM):
    model_cls = GraniteMoeHybridModel

    def _renamed(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """Granite's fused names -> the ones ``load_hf_weights`` knows: ``input_linear``
        is [gate; up] (per expert in the MoE), ``output_linear`` the down projection,
        ``router.layer`` the router."""
        if ".block_sparse_moe.router." in name:
            yield name.replace(".router.layer.", ".gate.").replace(".router.", ".gate."), tensor
            return
        moe = ".block_sparse_moe." in name
        experts = ".block_sparse_moe.experts." if moe else ".shared_mlp."
        base = name.split(".block_sparse_moe." if moe else ".shared_mlp.")[0] + experts
        if name.endswith(("input_linear.weight", "gate_up_proj")):
            gate, up = tensor.chunk(2, dim=-2)
            yield base + ("w1.weight" if moe else "gate_proj.weight"), gate
            yield base + ("w3.weight" if moe else "up_proj.weight"), up
        elif name.endswith(("output_linear.weight", "experts.down_proj")):
            yield base + ("w2.weight" if moe else "down_proj.weight"), tensor
        else:
            yield name, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        residual = self.mup.ssm_out

        def prepared() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                for new_name, new in self._renamed(name, tensor):
                    if any(part in new_name for part in _RESIDUAL_OUTPUTS):
                        new = new * residual
                    yield new_name, new

        return load_hf_weights(
            self, prepared(), LlamaForCausalLM.stacked_params, self.arch.tie_word_embeddings
        )
