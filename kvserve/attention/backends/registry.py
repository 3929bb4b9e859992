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

# name -> "module:Class". The torch backend (CPU_ATTN) is device-agnostic: CUDA falls
# back to it without Triton.
_BACKENDS: dict[str, str | None] = {
    "CPU_ATTN": "kvserve.attention.backends.cpu_attn:CPUAttentionBackend",
    "TRITON": "kvserve.attention.backends.triton_attn:TritonAttentionBackend",
    "FLASH_ATTN": "kvserve.attention.backends.flash_attn:FlashAttentionBackend",
    "FLASHINFER": "kvserve.attention.backends.flashinfer:FlashInferBackend",
}
# The packages a backend cannot load without (optional dependencies; any one will do).
_REQUIRES = {
    "TRITON": ("triton",),
    "FLASH_ATTN": ("vllm_flash_attn", "flash_attn"),
    "FLASHINFER": ("flashinfer",),
}
# CUDA's kernels, best first: FlashAttention where its wheel is installed, as vLLM picks.
_PREFERENCE = {"cpu": ("CPU_ATTN",), "cuda": ("FLASH_ATTN", "TRITON", "CPU_ATTN")}
# Backends that run on CUDA only: asked for elsewhere, or without their package, they
# give way to Triton (whose kernels the others share), with one log line.
_CUDA_ONLY = ("FLASH_ATTN", "FLASHINFER")
_FALLBACK = "CPU_ATTN"
ENV_BACKEND = "KVSERVE_ATTENTION_BACKEND"
# --attention-backend, set in the worker's process (set_attention_backend); the variable
# ENV_BACKEND is the other way to force one.
_forced: str | None = None


def set_attention_backend(name: str | None) -> None:
    """Force ``name`` for the layers built from now on in this process (None: choose)."""
    global _forced
    if name is not None and _BACKENDS.get(name) is None:
        raise ValueError(f"attention_backend {name!r} is not one of {available_backends()}")
    _forced = name


def available_backends() -> list[str]:
    return sorted(k for k, v in _BACKENDS.items() if v)


def _installed(name: str) -> bool:
    packages = _REQUIRES.get(name)
    return packages is None or any(importlib.util.find_spec(p) is not None for p in packages)


@functools.cache
def _log_fallback(preferred: str, device_type: str, chosen: str) -> None:
    if device_type != "cuda" and preferred in _CUDA_ONLY:  # forced on a CPU
        why = "runs on CUDA only"
    else:
        why = f"needs one of the packages {_REQUIRES.get(preferred)}, none installed"
    logger.info(
        "attention backend %s %s: %s on %s uses %s",
        preferred, why, device_type, device_type, chosen,
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
    """The backend for ``device``. ``name`` (or --attention-backend, or
    $KVSERVE_ATTENTION_BACKEND) forces one; FlashAttention and FlashInfer forced where they
    cannot run give way to Triton, with one log line."""
    device_type = torch.device(device if device is not None else "cpu").type
    forced = name or _forced or os.environ.get(ENV_BACKEND)
    if forced is not None:
        if _BACKENDS.get(forced) is None:
            raise ValueError(
                f"attention backend {forced!r} is not available: {available_backends()}"
            )
        if forced in _CUDA_ONLY and (device_type != "cuda" or not _installed(forced)):
            _log_fallback(forced, device_type, "TRITON")
            forced = "TRITON"
        if not _installed(forced):
            raise ValueError(
                f"attention backend {forced!r} needs one of the packages "
                f"{_REQUIRES[forced]!r}, none installed"
            )
        return _load(forced)
    preferences = _PREFERENCE.get(device_type, (_FALLBACK,))
    for candidate in preferences:
        if _installed(candidate):
            if candidate != preferences[0]:
                _log_fallback(preferences[0], device_type, candidate)
            return _load(candidate)
    return _load(_FALLBACK)
