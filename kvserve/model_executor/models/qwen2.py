"""Qwen2: the Llama decoder with biases on q/k/v (and none on o_proj)."""

from __future__ import annotations

from kvserve.model_executor.models.llama import LlamaForCausalLM
from kvserve.transformers_utils.arch_config import ArchConfig


class Qwen2ForCausalLM(LlamaForCausalLM):
    supports_tensor_parallel = True  # Llama's layers, with q/k/v biases

    @staticmethod
    def attention_biases(arch: ArchConfig) -> tuple[bool, bool]:
        return True, False
