"""The causal-LM shell of the Mamba-2 hybrids whose muP multipliers scale the logits
(FalconH1, Granite 4.0-H): the model built from (arch, multipliers), the LM head, tying."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from kvserve.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from kvserve.transformers_utils.arch_config import ArchConfig
from kvserve.transformers_utils.mamba_arch import MupMultipliers


class MupHybridForCausalLM(nn.Module):
    supports_tensor_parallel: ClassVar[bool] = False
    supports_pipeline_parallel: ClassVar[bool] = False
    # The decoder stack: (arch, multipliers, prefix=) -> module with embed_tokens.
    model_cls: ClassVar[Callable[..., Any]]

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        if arch.mamba is None:
            raise ValueError(f"{type(self).__name__} needs the config's Mamba fields")
        self.arch = arch
        self.mup = arch.mup or MupMultipliers()
        self.model = self.model_cls(arch, self.mup, prefix="model")
        self.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size, prefix="lm_head")
        if arch.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = self.model.forward(input_ids, positions)
        return output

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states) * self.mup.lm_head
