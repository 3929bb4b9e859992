"""Phi-3 (mini / medium, RoPE without longrope scaling): the Llama decoder whose
checkpoint already fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``.
Loading cuts them back into the per-projection shards, so tensor parallelism slices
each part as it does for Llama."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from kvserve.model_executor.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._unfused(weights))

    def _unfused(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        arch = self.arch
        q_size = arch.num_attention_heads * arch.head_dim
        kv_size = arch.num_key_value_heads * arch.head_dim
        for name, tensor in weights:
            if ".qkv_proj." in name:
                parts = tensor.split([q_size, kv_size, kv_size], dim=0)
                for proj, part in zip(("q_proj", "k_proj", "v_proj"), parts, strict=True):
                    yield name.replace("qkv_proj", proj), part
            elif ".gate_up_proj." in name:
                gate, up = tensor.chunk(2, dim=0)
                yield name.replace("gate_up_proj", "gate_proj"), gate
                yield name.replace("gate_up_proj", "up_proj"), up
            else:
                yield name, tensor
