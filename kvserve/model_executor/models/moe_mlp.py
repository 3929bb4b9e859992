"""The sparse MLP block of MoE decoders: router, routed experts (``FusedMoE``) and the
optional shared experts every token also passes through (DeepSeek)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model_executor.layers.fused_moe import FusedMoE
from kvserve.model_executor.models.llama import LlamaMLP
from kvserve.transformers_utils.arch_families import MoEConfig


class MoERouter(nn.Module):
    """Router logits ``x W^T`` (replicated on every TP rank), in float32 as HF scores
    them; DeepSeek-V3 adds a per-expert correction bias used only to choose experts."""

    def __init__(self, config: MoEConfig, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(config.num_experts, hidden_size), requires_grad=False
        )
        self.e_score_correction_bias: nn.Parameter | None = None
        if config.has_correction_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(config.num_experts), requires_grad=False
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


class SparseMoeBlock(nn.Module):
    """``experts(x) + shared_experts(x)``; checkpoint names ``gate``, ``experts.{e}.*``,
    ``shared_experts.*`` (Qwen3-MoE, DeepSeek; Mixtral's are renamed at load)."""

    def __init__(self, config: MoEConfig, hidden_size: int, prefix: str) -> None:
        super().__init__()
        self.gate = MoERouter(config, hidden_size)
        self.experts = FusedMoE(config, hidden_size, prefix=f"{prefix}.experts")
        self.shared_experts: LlamaMLP | None = None
        if config.num_shared_experts:
            self.shared_experts = LlamaMLP(
                hidden_size,
                config.intermediate_size * config.num_shared_experts,
                prefix=f"{prefix}.shared_experts",
            )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate.forward(hidden_states)
        out = self.experts.forward(hidden_states, router_logits, self.gate.e_score_correction_bias)
        if self.shared_experts is not None:
            out = out + self.shared_experts.forward(hidden_states)
        return out
