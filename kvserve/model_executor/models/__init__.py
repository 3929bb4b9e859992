"""Model definitions and the architecture registry."""

from __future__ import annotations

from kvserve.model_executor.models.registry import get_model_cls, supported_architectures

__all__ = ["get_model_cls", "supported_architectures"]
