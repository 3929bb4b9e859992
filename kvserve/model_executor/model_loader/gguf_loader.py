"""Read GGUF tensors, dequantize them to float32 and rename them to HF names."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from kvserve.transformers_utils.arch_config import ArchConfig
from kvserve.transformers_utils.gguf_reader import GGUFFile, GGUFTensor, open_gguf

# GGUF per-block tensor stem -> HF module path inside `model.layers.{i}`.
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Qwen3's per-head q/k norms.
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    # Mixture of experts: the router, all experts stacked ([E, I, H] / [E, H, I] in
    # torch order; FusedMoE loads them whole) and the shared expert.
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
# Gemma 3 names its four per-layer norms differently (ffn_norm is the pre-MLP norm).
_GEMMA3_BLOCK_NAMES = {
    **_BLOCK_NAMES,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_BLOCK_NAMES_BY_ARCH = {"gemma3": _GEMMA3_BLOCK_NAMES}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Consumed elsewhere (rope_freqs -> ArchConfig.rope_scaling) or not model weights.
_SKIPPED = {"rope_freqs.weight"}
_PLAIN_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def gguf_to_hf_name(name: str, gguf_arch: str = "llama") -> str:
    match = _BLOCK_RE.match(name)
    if match:
        layer, stem, kind = match.groups()
        block_names = _BLOCK_NAMES_BY_ARCH.get(gguf_arch, _BLOCK_NAMES)
        if stem in block_names:
            return f"model.layers.{layer}.{block_names[stem]}.{kind}"
    else:
        stem, _, kind = name.rpartition(".")
        if stem in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[stem]}.{kind}"
    raise ValueError(f"unexpected GGUF tensor {name!r}")


def dequantize_tensor(tensor: GGUFTensor) -> np.ndarray:
    """float32 array in torch layout: GGUF lists dims fastest-first, so reverse them."""
    shape = tuple(int(d) for d in reversed(tensor.shape))
    if tensor.tensor_type == GGMLQuantizationType.F32:
        # Copy: the reader's memory map is read-only and torch wants writable memory.
        data = np.array(tensor.data, dtype=np.float32)
    else:
        data = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
    return data.reshape(shape)


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation for the llama architecture.

    llama.cpp rotates interleaved pairs (x0,x1),(x2,x3)...; its converter reorders each
    head's rows so that HF's rotate-half weights work with that. Swapping the axes
    back restores HF's layout, where a head's first half pairs with its second half.
    """
    rows = weight.shape[0]
    head_dim = rows // num_heads
    per_head = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return per_head.swapaxes(1, 2).reshape(weight.shape)


def _hf_rows(
    reader: GGUFFile, tensor: GGUFTensor, rows: np.ndarray, arch: ArchConfig
) -> np.ndarray:
    """``rows`` (one per output feature, dequantized or raw block bytes) in HF's order."""
    if reader.get("general.architecture") != "llama":
        return rows
    if ".attn_q." in tensor.name:
        return unpermute_rope_rows(rows, arch.num_attention_heads)
    if ".attn_k." in tensor.name:
        return unpermute_rope_rows(rows, arch.num_key_value_heads)
    return rows


def _hf_values(gguf_arch: str, name: str, weight: np.ndarray) -> np.ndarray:
    # llama.cpp's Gemma converter stores every RMSNorm weight as HF's value + 1 (its
    # norm multiplies by the weight, HF's by 1 + weight); subtract it back in float32,
    # as transformers' own GGUF loader does, so both hold the same parameter.
    if gguf_arch == "gemma3" and name.endswith("norm.weight"):
        return weight - np.float32(1.0)
    return weight


def iterate_gguf_weights(
    path: str, arch: ArchConfig, prepared: Mapping[str, torch.Tensor] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 tensor)`` for every weight in the GGUF file; ``prepared``
    (HF name -> tensor) replaces gguf's dequantization for the weights the block path
    already holds (see quantization.attach_gguf_blocks)."""
    reader = open_gguf(path)
    gguf_arch = str(reader.get("general.architecture"))
    for tensor in reader.tensors:
        if tensor.name in _SKIPPED:
            continue
        if prepared and (hf_name := gguf_to_hf_name(tensor.name, gguf_arch)) in prepared:
            yield hf_name, prepared[hf_name]
            continue
        weight = _hf_rows(reader, tensor, dequantize_tensor(tensor), arch)
        weight = _hf_values(gguf_arch, tensor.name, weight)
        # from_numpy shares memory; the copy into the parameter happens in load_weights.
        hf_name = gguf_to_hf_name(tensor.name, gguf_arch)
        yield hf_name, torch.from_numpy(np.ascontiguousarray(weight))


def iterate_gguf_blocks(
    path: str, arch: ArchConfig
) -> Iterator[tuple[str, GGMLQuantizationType, np.ndarray]]:
    """Yield ``(hf_name, type, raw)`` for every block-quantized 2-D tensor, ``raw`` being
    uint8 ``[rows, bytes per row]`` exactly as stored, rows in HF's order."""
    reader = open_gguf(path)
    gguf_arch = str(reader.get("general.architecture"))
    for tensor in reader.tensors:
        if tensor.name in _SKIPPED or tensor.tensor_type in _PLAIN_TYPES:
            continue
        raw = np.asarray(tensor.data, dtype=np.uint8)
        if raw.ndim != 2:
            continue
        hf_name = gguf_to_hf_name(tensor.name, gguf_arch)
        yield hf_name, tensor.tensor_type, _hf_rows(reader, tensor, raw, arch)
