"""Rotary position embeddings (neox / HF ``rotate_half`` layout) with scaling variants.

With the C++ kernels, q and k are rotated in place from a ``cos_sin_cache`` table
(vLLM's layout: cos then sin per position) built once with the same float32 expression
HF uses; without them, cos/sin are computed from ``positions`` on each call. Both give
HF's values bit for bit. ``get_rope`` hands every layer the same module, as vLLM does.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kvserve import _custom_ops as ops


def _default_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (base**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Low frequencies (long wavelengths) are divided by `factor`, high ones kept, and
    # the band between is interpolated smoothly.
    factor = float(scaling["factor"])
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_ctx / low
    high_freq_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_factor(scaling: dict[str, Any]) -> float:
    factor = scaling.get("factor")
    if factor is None:  # implied by the context extension, as HF reads it
        factor = scaling["max_position_embeddings"] / scaling["original_max_position_embeddings"]
    return float(factor)


def _yarn_inv_freq(rotary_dim: int, base: float, scaling: dict[str, Any]) -> torch.Tensor:
    # YaRN: frequencies that turn less than beta_slow times over the original context are
    # interpolated (divided by factor), those turning more than beta_fast times kept, a
    # linear ramp between (HF's _compute_yarn_parameters, same float32 expressions).
    factor = _yarn_factor(scaling)
    old_ctx = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (rotary_dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp(
        (torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1
    )
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    extrapolation_weight = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (
        1.0 / pos_freqs
    ) * extrapolation_weight


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """YaRN's factor on cos and sin (1 for every other rope type)."""
    if not scaling or scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _yarn_factor(scaling)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
    return yarn_get_mscale(factor)


def compute_inv_freq(rotary_dim: int, base: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = _default_inv_freq(rotary_dim, base)
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    assert scaling is not None
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "yarn":
        return _yarn_inv_freq(rotary_dim, base, scaling)
    if rope_type == "freq_factors":  # llama.cpp's precomputed llama3 divisors
        return inv_freq / torch.tensor(scaling["freq_factors"], dtype=torch.float32)
    raise ValueError(f"unsupported rope_type {rope_type!r}")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    inv_freq: torch.Tensor
    # get_rope hands one instance to every model of its configuration, so its tables
    # outlive any one model: utils/huge_pages leaves them where they are.
    shared_across_models = True

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        base: float,
        rope_scaling: dict[str, Any] | None = None,
        max_position: int = 2048,
    ) -> None:
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        inv_freq = compute_inv_freq(rotary_dim, base, rope_scaling)
        # YaRN scales cos and sin (1.0 otherwise: the tables stay HF's exact values).
        self.attention_factor = rope_attention_factor(rope_scaling)
        # Non-persistent: derived from config, never part of a checkpoint.
        self.register_buffer("inv_freq", inv_freq.to(torch.get_default_device()), persistent=False)
        self._cos_sin_cache: torch.Tensor | None = None

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, rotary_dim]
        if self.attention_factor != 1.0:
            return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor
        return emb.cos(), emb.sin()

    @property
    def cos_sin_cache(self) -> torch.Tensor:
        """``[max_position, rotary_dim]``: cos of each frequency, then sin (built once)."""
        if self._cos_sin_cache is None or self._cos_sin_cache.device != self.inv_freq.device:
            positions = torch.arange(self.max_position, device=self.inv_freq.device)
            freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
            cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
            if self.attention_factor != 1.0:
                cos_sin = cos_sin * self.attention_factor
            self._cos_sin_cache = cos_sin.contiguous()
        return self._cos_sin_cache

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        rot = (rot.float() * cos + _rotate_half(rot.float()) * sin).to(x.dtype)
        return torch.cat((rot, rest), dim=-1) if rest.numel() else rot

    @property
    def is_pure_rotation(self) -> bool:
        """Whether rotating by a then by b equals rotating by a + b (not with YaRN's
        scaled cos/sin): what moving cached keys to other positions relies on."""
        return self.attention_factor == 1.0

    def rotate_by(self, key: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """``key [T, heads, head_size]`` rotated by ``delta [T]`` positions (negative
        too): rotations compose, so keys rotated at position p and rotated by d equal keys
        rotated at p + d, up to float rounding. Computed from ``inv_freq``, not the
        table, which holds non-negative positions only."""
        if not self.is_pure_rotation:
            raise ValueError("keys under YaRN's scaled rotary cannot be moved to new positions")
        cos, sin = self._cos_sin(delta)
        return self._rotate(key, cos, sin)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``query [T, H*hd]``, ``key [T, Hkv*hd]`` -> rotated, same shapes. The kernel
        path rotates in place (the inputs are the fresh qkv projection's views)."""
        if ops.use_for(query) and query.stride(-1) == 1 and key.stride(-1) == 1:
            # The property's device check costs more than the kernel for one token; a
            # CPU-resident table is current (the kernel path only runs on CPU tensors).
            cache = self._cos_sin_cache
            if cache is None or not cache.is_cpu:
                cache = self.cos_sin_cache
            ops.rotary_embedding(positions, query, key, self.head_size, cache)
            return query, key
        num_tokens = positions.shape[0]
        cos, sin = self._cos_sin(positions)
        q = self._rotate(query.view(num_tokens, -1, self.head_size), cos, sin)
        k = self._rotate(key.view(num_tokens, -1, self.head_size), cos, sin)
        return q.reshape(query.shape), k.reshape(key.shape)


_ROPE_CACHE: dict[tuple[Any, ...], RotaryEmbedding] = {}


def get_rope(
    head_size: int,
    base: float,
    rope_scaling: dict[str, Any] | None = None,
    rotary_dim: int | None = None,
    max_position: int = 2048,
) -> RotaryEmbedding:
    """One shared module per configuration (and default device), so every layer of a
    model indexes the same cos/sin table."""
    scaling_key = tuple(sorted((k, repr(v)) for k, v in (rope_scaling or {}).items()))
    key = (head_size, base, scaling_key, rotary_dim, max_position, str(torch.get_default_device()))
    if key not in _ROPE_CACHE:
        _ROPE_CACHE[key] = RotaryEmbedding(
            head_size, rotary_dim or head_size, base, rope_scaling, max_position
        )
    return _ROPE_CACHE[key]
