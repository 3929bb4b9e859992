"""Model discovery helpers: where a model lives, its architecture config, its tokenizer."""

from __future__ import annotations

from kvserve.transformers_utils.arch_config import ArchConfig, load_arch_config
from kvserve.transformers_utils.model_resolver import ResolvedModel, resolve_model
from kvserve.transformers_utils.tokenizer import get_tokenizer

__all__ = ["ArchConfig", "ResolvedModel", "get_tokenizer", "load_arch_config", "resolve_model"]
