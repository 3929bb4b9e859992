"""Decode steps of a Llama-family decoder stack as one C++ call.

A decode step runs ~15 small ops per layer; through the Python modules and torch's
dispatcher that framework time is several milliseconds per token on a 30-layer model,
as much as the quantized matmuls themselves. ``torch.classes.kvserve.DecoderStack``
(csrc/decode_stack.cpp) holds the layers' weights and calls the same kernels in the same
order, so its result equals the module path bit for bit.

It takes a step only when that step is what it implements: every token a decode row of
the CPU attention backend, no KV connector (whose per-layer hooks run between layers),
the C++ kernels in use. Anything else (prefill chunks, CUDA, torch fallbacks) takes the
modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvserve import _custom_ops as ops
from kvserve.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionMetadata
from kvserve.forward_context import get_forward_context, is_forward_context_set
from kvserve.model_executor.layers.layernorm import RMSNorm

if TYPE_CHECKING:
    from kvserve.model_executor.layers.linear import LinearBase
    from kvserve.model_executor.models.llama import LlamaDecoderLayer

_EMPTY = torch.empty(0)


def _projection(linear: LinearBase) -> tuple[list[torch.Tensor], int, bool]:
    """(weight, d, m, packed), kind (-1: float32 weight), int8 activations."""
    bw = linear.quant_weight
    if bw is None:
        return [linear.weight, _EMPTY, _EMPTY, _EMPTY], -1, False
    packed = bw.packed if bw.packed is not None else _EMPTY
    return [bw.qs, bw.d, bw.m, packed], bw.kind, bw.int8_activations


def _decode_step_metadata() -> CPUAttentionMetadata | None:
    """This step's attention metadata when the stack can run it, else None."""
    if not is_forward_context_set():
        return None
    ctx = get_forward_context()
    md = ctx.attn_metadata
    if ctx.kv_connector is not None or type(md) is not CPUAttentionMetadata:
        return None
    if md.prefills or md.kernel_decode is None or md.all_slots is None:
        return None
    return md


class LlamaDecodeStack:
    """The native decode path of one ``LlamaModel``, built on its first decode step."""

    def __init__(self, layers: list[LlamaDecoderLayer], final_norm: RMSNorm | None = None) -> None:
        self.layers = layers
        # The model's norm after the last layer; applied in the C++ step when it is
        # Llama's RMSNorm (``applies_final_norm``), by the model otherwise.
        self.final_norm = final_norm
        self.applies_final_norm = False
        # torch.classes.kvserve.DecoderStack (a ScriptObject, untyped for mypy).
        self._stack: Any = None
        self._supported: bool | None = None
        self._caches: list[torch.Tensor] = []

    def _build(self) -> Any:
        first = self.layers[0].self_attn
        rope = first.rotary_emb
        attn = first.attn
        eps = self.layers[0].input_layernorm.eps
        for layer in self.layers:
            a = layer.self_attn
            if (
                a.rotary_emb is not rope
                or a.attn.backend is not CPUAttentionBackend
                or not getattr(a.attn.impl, "kernel_supported", False)  # chunked, sinks, cap
                or a.attn.scale != attn.scale
                or (a.attn.num_heads, a.attn.num_kv_heads) != (attn.num_heads, attn.num_kv_heads)
                or layer.input_layernorm.eps != eps
                or layer.post_attention_layernorm.eps != eps
                or a.qkv_proj.tp_size != 1
                or a.o_proj.tp_size != 1
                or layer.mlp.gate_up_proj.bias is not None
                or layer.mlp.down_proj.bias is not None
            ):
                return None
        stack: Any = ops.decoder_stack(
            attn.num_heads, attn.num_kv_heads, attn.head_size, eps,
            attn.scale, rope.cos_sin_cache,
        )  # fmt: skip
        for layer in self.layers:
            a, mlp = layer.self_attn, layer.mlp
            planes: list[torch.Tensor] = []
            kinds: list[int] = []
            int8: list[bool] = []
            for linear in (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj):
                tensors, kind, int8_activations = _projection(linear)
                planes += tensors
                kinds.append(kind)
                int8.append(int8_activations)
            stack.add_layer(
                layer.input_layernorm.weight, layer.post_attention_layernorm.weight, planes,
                kinds, int8, a.qkv_proj.bias, a.o_proj.bias, a.attn.sliding_window or 0,
            )  # fmt: skip
        norm = self.final_norm
        if type(norm) is RMSNorm:  # not a subclass with its own arithmetic
            stack.set_final_norm(norm.weight, norm.eps)
            self.applies_final_norm = True
        return stack

    def _kv_caches(self) -> list[torch.Tensor]:
        """The layers' KV caches, handed to the C++ stack whenever they change.

        bind_kv_cache rebinds every layer at once, so the ends tell whether the list is
        current (nn.Module attribute lookups cost ~2 us each, 90 per step otherwise)."""
        first, last = self.layers[0].self_attn.attn, self.layers[-1].self_attn.attn
        cached = self._caches
        if not cached or cached[0] is not first.kv_cache or cached[-1] is not last.kv_cache:
            self._caches = [layer.self_attn.attn.kv_cache for layer in self.layers]
            self._stack.set_kv_caches(self._caches)
        return self._caches

    def forward(
        self, hidden_states: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(MLP output, residual) of the last layer, or None: run the modules instead.
        With ``applies_final_norm`` the first is already the final norm's output."""
        if self._supported is False or not ops.use_for(hidden_states):
            return None
        md = _decode_step_metadata()
        if md is None or not hidden_states.is_contiguous():
            return None
        if self._stack is None:
            self._stack = self._build()
            self._supported = self._stack is not None
            if self._stack is None:
                return None
        caches = self._kv_caches()
        if caches[0].numel() == 0:
            return None
        assert md.kernel_decode is not None and md.all_slots is not None
        block_table, seq_lens, token_indices = md.kernel_decode
        return self._stack.forward(  # type: ignore[no-any-return]
            hidden_states, positions, md.all_slots, block_table, seq_lens, token_indices,
            md.num_actual_tokens,
        )  # fmt: skip
