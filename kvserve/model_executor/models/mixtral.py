"""Mixtral: the Llama decoder (sliding window where the config sets one) whose MLP is a
softmax top-k router over experts, top-k weights renormalised. Checkpoints name the
block ``block_sparse_moe`` and an expert's projections ``w1`` (gate), ``w3`` (up) and
``w2`` (down); loading renames the block to ``mlp``."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from kvserve.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from kvserve.model_executor.models.moe_mlp import SparseMoeBlock
from kvserve.transformers_utils.arch_config import ArchConfig


class MixtralDecoderLayer(LlamaDecoderLayer):
    runs_in_decode_stack = False  # routed experts

    def make_mlp(self, arch: ArchConfig, prefix: str, layer_idx: int) -> nn.Module:
        assert arch.moe is not None, "Mixtral's config names its experts"
        return SparseMoeBlock(arch.moe, arch.hidden_size, prefix)


class MixtralForCausalLM(LlamaForCausalLM):
    supports_tensor_parallel = True  # experts split on their intermediate dim
    decoder_layer_cls = MixtralDecoderLayer

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(_renamed(weights))


def _renamed(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        yield name.replace(".block_sparse_moe.", ".mlp."), tensor
