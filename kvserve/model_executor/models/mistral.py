"""Mistral: the Llama decoder with sliding-window attention on every layer (the window
comes from ``ArchConfig.sliding_window``; Llama's layers already take it per layer)."""

from __future__ import annotations

from kvserve.model_executor.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    supports_tensor_parallel = True  # Llama's layers
