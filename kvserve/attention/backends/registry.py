"""Attention backend selection by device (and optional explicit name)."""

from __future__ import annotations

import importlib
import os

import torch

from kvserve.attention.backends.abstract import AttentionBackend

# name -> "module:Class". GPU_FLASH is the slot for a Triton / FlashAttention backend;
# until it is registered, CUDA falls back to the torch backend, which is device-agnostic.
_BACKENDS: dict[str, str | None] = {
    "CPU_ATTN": "kvserve.attention.backends.cpu_attn:CPUAttentionBackend",
    "GPU_FLASH": None,
}
_DEFAULT_FOR_DEVICE = {"cpu": "CPU_ATTN", "cuda": "GPU_FLASH"}
_FALLBACK = "CPU_ATTN"
ENV_BACKEND = "KVSERVE_ATTENTION_BACKEND"


def register_backend(name: str, target: str) -> None:
    """Register ``target`` ("module:Class") under ``name`` (e.g. from a plugin)."""
    _BACKENDS[name] = target


def _load(name: str) -> type[AttentionBackend]:
    target = _BACKENDS[name]
    assert target is not None
    module_name, cls_name = target.split(":")
    return getattr(importlib.import_module(module_name), cls_name)


def get_attn_backend(
    device: torch.device | str | None = None, name: str | None = None
) -> type[AttentionBackend]:
    """The backend for ``device``. ``name`` (or $KVSERVE_ATTENTION_BACKEND) forces one."""
    forced = name or os.environ.get(ENV_BACKEND)
    if forced is not None:
        if _BACKENDS.get(forced) is None:
            available = sorted(k for k, v in _BACKENDS.items() if v)
            raise ValueError(f"attention backend {forced!r} is not available: {available}")
        return _load(forced)
    device_type = torch.device(device if device is not None else "cpu").type
    preferred = _DEFAULT_FOR_DEVICE.get(device_type, _FALLBACK)
    return _load(preferred if _BACKENDS.get(preferred) else _FALLBACK)
