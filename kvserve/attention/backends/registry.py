"""Attention backend selection by device (and optional explicit name)."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os

import torch

from kvserve.attention.backends.abstract import AttentionBackend

logger = logging.getLogger(__name__)

# name -> "module:Class". FLASH_ATTN is the slot for a FlashAttention backend. The torch
# backend (CPU_ATTN) is device-agnostic: CUDA falls back to it without Triton.
_BACKENDS: dict[str, str | None] = {
    "CPU_ATTN": "kvserve.attention.backends.cpu_attn:CPUAttentionBackend",
    "TRITON": "kvserve.attention.backends.triton_attn:TritonAttentionBackend",
    "FLASH_ATTN": None,
}
# The package a backend cannot load without (an optional dependency).
_REQUIRES = {"TRITON": "triton"}
_DEFAULT_FOR_DEVICE = {"cpu": "CPU_ATTN", "cuda": "TRITON"}
_FALLBACK = "CPU_ATTN"
ENV_BACKEND = "KVSERVE_ATTENTION_BACKEND"


def _installed(name: str) -> bool:
    package = _REQUIRES.get(name)
    return package is None or importlib.util.find_spec(package) is not None


@functools.cache
def _log_fallback(preferred: str, device_type: str) -> None:
    logger.info(
        "attention backend %s needs the %s package, not installed: %s on %s uses %s",
        preferred, _REQUIRES.get(preferred), device_type, device_type, _FALLBACK,
    )  # fmt: skip


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
        if not _installed(forced):
            raise ValueError(
                f"attention backend {forced!r} needs the {_REQUIRES[forced]!r} package, "
                "which is not installed"
            )
        return _load(forced)
    device_type = torch.device(device if device is not None else "cpu").type
    preferred = _DEFAULT_FOR_DEVICE.get(device_type, _FALLBACK)
    if not _BACKENDS.get(preferred):
        return _load(_FALLBACK)
    if not _installed(preferred):
        _log_fallback(preferred, device_type)
        return _load(_FALLBACK)
    return _load(preferred)
