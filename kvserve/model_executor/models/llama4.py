"""Llama 4 text, dense layers only (``Llama4ForCausalLM``): the Llama decoder with
chunked local attention (``attention_chunk_size``) on every RoPE layer.

Two checkpoint differences from Llama are undone at load: the MLP is named
``feed_forward``, and RoPE rotates interleaved pairs ``(x0, x1), (x2, x3), ...``
(complex multiplication) where kvserve rotates halves. Reordering each head's q/k rows
evens-then-odds turns one into the other without changing any q.k product.
MoE layers, NoPE layers (with their temperature tuning) and q/k L2 norms are refused
by ``ArchConfig`` until they are written.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from kvserve.model_executor.models.llama import LlamaForCausalLM


def interleaved_to_halves(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rows of each head reordered ``0, 2, 4, ..., 1, 3, 5, ...``."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    per_head = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return per_head.transpose(1, 2).reshape(weight.shape)


class Llama4ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._as_llama(weights))

    def _as_llama(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        arch = self.arch
        for name, tensor in weights:
            name = name.replace(".feed_forward.", ".mlp.")
            if ".self_attn.q_proj." in name:
                tensor = interleaved_to_halves(tensor, arch.num_attention_heads)
            elif ".self_attn.k_proj." in name:
                tensor = interleaved_to_halves(tensor, arch.num_key_value_heads)
            yield name, tensor
