"""Model definitions and the architecture registry."""

from __future__ import annotations

from kvserve.model_executor.models.registry import (
    ModelRegistry,
    get_model_cls,
    supported_architectures,
)

__all__ = ["ModelRegistry", "get_model_cls", "supported_architectures"]
