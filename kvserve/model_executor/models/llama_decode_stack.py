"""Decode steps of a Llama-family or Gemma 3 decoder stack as one C++ call.

A decode step runs ~15 small ops per layer; through the Python modules and torch's
dispatcher that framework time is several milliseconds per token on a 30-layer model,
as much as the quantized matmuls themselves. ``torch.classes.kvserve.DecoderStack``
(csrc/decode_stack.cpp) holds the layers' weights and calls the same kernels in the same
order, so its result equals the module path bit for bit.

The layers it reads have Llama's parts (``input_layernorm``, ``self_attn`` with
``qkv_proj``/``o_proj``/``rotary_emb``/``attn``, ``post_attention_layernorm``, ``mlp``
with ``gate_up_proj``/``down_proj``/``act_fn``), optionally per-head ``q_norm``/``k_norm``
before RoPE (Qwen3, Gemma 3) and Gemma 3's ``pre_feedforward_layernorm`` and
``post_feedforward_layernorm`` (the sandwich scheme: each sublayer's output normed before
its residual add), GELU(tanh), each layer its own RoPE table. The model that builds the
stack vouches that its layers' forward is one of these two schemes.

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
from kvserve.model_executor.layers.activation import GeluAndMul, SiluAndMul
from kvserve.model_executor.layers.block_weight import MixedBlockWeight
from kvserve.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm
from kvserve.model_executor.layers.rotary_embedding import RotaryEmbedding

if TYPE_CHECKING:
    from torch import nn

    from kvserve.model_executor.layers.linear import LinearBase

_EMPTY = torch.empty(0)


def _projection(linear: LinearBase) -> list[tuple[list[torch.Tensor], int, bool]]:
    """Each part of the layer's output features (one, unless its blocks are a
    MixedBlockWeight): (weight, d, m, packed), kind (-1: float32 weight), int8 activations."""
    quant = linear.quant_weight
    if quant is None:
        return [([linear.weight, _EMPTY, _EMPTY, _EMPTY], -1, False)]
    parts = quant.parts if isinstance(quant, MixedBlockWeight) else [quant]
    return [
        ([bw.qs, bw.d, bw.m, bw.packed if bw.packed is not None else _EMPTY], bw.kind,
         bw.int8_activations)
        for bw in parts
    ]  # fmt: skip


def _norm_weight(norm: nn.Module | None) -> torch.Tensor | None:
    """The kernels' factor of a norm module (Gemma's ``1 + w``); None: not a norm the
    stack computes (a subclass may have its own arithmetic)."""
    if type(norm) is RMSNorm:
        return norm.weight
    if type(norm) is GemmaRMSNorm:
        return norm.kernel_scale()
    return None


def _activation(act_fn: nn.Module) -> int | None:
    """csrc's Activation value of an MLP's gate activation, None: not one it has."""
    if type(act_fn) is SiluAndMul:
        return 0
    if type(act_fn) is GeluAndMul and act_fn.approximate == "tanh":
        return 1
    return None


def _eps(norm: nn.Module) -> float:
    eps = norm.eps
    assert isinstance(eps, float)
    return eps


def _decode_ready(md: Any) -> bool:
    """Whether one KV cache group's metadata is a step the stack implements."""
    return (
        type(md) is CPUAttentionMetadata
        and not md.prefills
        and md.kernel_decode is not None
        and md.all_slots is not None
    )


def _step_metadata() -> Any:
    """This step's attention metadata (one, or by layer name for several KV cache
    groups), None where no step is set or a KV connector's per-layer hooks must run."""
    if not is_forward_context_set():
        return None
    ctx = get_forward_context()
    return None if ctx.kv_connector is not None else ctx.attn_metadata


class LlamaDecodeStack:
    """The native decode path of one decoder stack (Llama family, Gemma 3), built on its
    first decode step."""

    def __init__(self, layers: list[nn.Module], final_norm: nn.Module | None = None) -> None:
        self.layers: list[Any] = layers  # decoder layers as the module docstring says
        # The model's norm after the last layer; applied in the C++ step when the stack
        # computes that kind (``applies_final_norm``), by the model otherwise.
        self.final_norm = final_norm
        self.applies_final_norm = False
        # torch.classes.kvserve.DecoderStack (a ScriptObject, untyped for mypy).
        self._stack: Any = None
        self._supported: bool | None = None
        self._caches: list[torch.Tensor] = []
        # A hybrid model's step metadata comes by layer name, one object per KV cache
        # group: the first layer name of each group, in the stack's group order (None:
        # one metadata for every layer).
        self._group_leaders: list[str] | None = None

    def _layer_args(self, layer: Any, eps: float) -> list[Any] | None:
        """add_layer's arguments for one decoder layer, None: the stack cannot run it."""
        a, mlp = layer.self_attn, layer.mlp
        if not hasattr(mlp, "gate_up_proj"):  # routed experts (Qwen3-MoE's sparse layers)
            return None
        sandwich = hasattr(layer, "pre_feedforward_layernorm")
        norm_modules = [layer.input_layernorm, layer.post_attention_layernorm]
        if sandwich:
            norm_modules += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
        q_norm, k_norm = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
        if q_norm is not None:
            norm_modules += [q_norm, k_norm]
        weights = [_norm_weight(n) for n in norm_modules]
        activation = _activation(mlp.act_fn)
        if (
            any(w is None for w in weights)
            or any(_eps(n) != eps for n in norm_modules)
            # Llama's scheme runs its norms as fused add + norm: RMSNorm's kernels.
            or not (sandwich or all(type(n) is RMSNorm for n in norm_modules[:2]))
            or activation is None
            or type(a.rotary_emb) is not RotaryEmbedding
            or a.attn.backend is not CPUAttentionBackend
            or not getattr(a.attn.impl, "kernel_supported", False)  # chunked, sinks, cap
            or a.attn.kv_cache.dtype == torch.int8  # the stack's attention reads floats
            or a.qkv_proj.tp_size != 1
            or a.o_proj.tp_size != 1
            or mlp.gate_up_proj.bias is not None
            or mlp.down_proj.bias is not None
        ):
            return None
        planes: list[torch.Tensor] = []
        kinds: list[int] = []
        int8: list[bool] = []
        part_counts: list[int] = []
        for linear in (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj):
            parts = _projection(linear)
            part_counts.append(len(parts))
            for tensors, kind, int8_activations in parts:
                planes += tensors
                kinds.append(kind)
                int8.append(int8_activations)
        qk = weights[-2:] if q_norm is not None else [None, None]
        return [
            weights[0], weights[1], planes, kinds, int8, part_counts, a.qkv_proj.bias,
            a.o_proj.bias,
            a.attn.sliding_window or 0, weights[2:4] if sandwich else [], *qk,
            a.rotary_emb.cos_sin_cache, activation,
        ]  # fmt: skip

    def _build(self, md: Any) -> Any:
        attn = self.layers[0].self_attn.attn
        eps = _eps(self.layers[0].input_layernorm)
        layer_args = []
        for layer in self.layers:
            a = layer.self_attn
            args = self._layer_args(layer, eps)
            if (
                args is None
                or a.attn.scale != attn.scale
                or (a.attn.num_heads, a.attn.num_kv_heads, a.attn.head_size)
                != (attn.num_heads, attn.num_kv_heads, attn.head_size)
            ):
                return None
            layer_args.append(args)
        stack: Any = ops.decoder_stack(
            attn.num_heads, attn.num_kv_heads, attn.head_size, eps,
            attn.scale, self.layers[0].self_attn.rotary_emb.cos_sin_cache,
        )  # fmt: skip
        for args in layer_args:
            stack.add_layer(*args)
        if isinstance(md, dict):  # KV cache groups by identity of their metadata
            groups: list[int] = []
            firsts: dict[int, str] = {}
            for layer in self.layers:
                name = layer.self_attn.attn.layer_name
                firsts.setdefault(id(md[name]), name)
                groups.append(list(firsts).index(id(md[name])))
            self._group_leaders = list(firsts.values())
            stack.set_kv_groups(groups)
        final = _norm_weight(self.final_norm)
        # Llama's scheme fuses the last add into RMSNorm; the sandwich one norms the stream.
        sandwich = hasattr(self.layers[-1], "pre_feedforward_layernorm")
        if final is not None and (sandwich or type(self.final_norm) is RMSNorm):
            assert self.final_norm is not None
            stack.set_final_norm(final, _eps(self.final_norm))
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
        step_md = _step_metadata()
        if step_md is None or not hidden_states.is_contiguous():
            return None
        if isinstance(step_md, dict):
            leaders = self._group_leaders
            mds = [step_md[self.layers[0].self_attn.attn.layer_name]] if leaders is None else [
                step_md[name] for name in leaders
            ]  # fmt: skip
        else:
            mds = [step_md]
        if not all(_decode_ready(md) for md in mds):
            return None
        if self._stack is None:
            self._stack = self._build(step_md)
            self._supported = self._stack is not None
            if self._stack is None:
                return None
            return self.forward(hidden_states, positions)  # with the groups now known
        if isinstance(step_md, dict) != (self._group_leaders is not None):
            return None  # not the metadata shape the stack was built for
        caches = self._kv_caches()
        if caches[0].numel() == 0:
            return None
        return self._stack.forward(  # type: ignore[no-any-return]
            hidden_states, positions, [md.all_slots for md in mds],
            [md.kernel_decode[0] for md in mds], [md.kernel_decode[1] for md in mds],
            [md.kernel_decode[2] for md in mds], mds[0].num_actual_tokens,
        )  # fmt: skip
