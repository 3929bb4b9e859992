"""Logits processors: the vLLM v1 interface, the built-ins and the batch's processor set."""

from __future__ import annotations

from kvserve.sample.logits_processor.builtin import (
    BUILTIN_LOGITS_PROCESSORS,
    AllowedTokenIdsLogitsProcessor,
    BadWordsLogitsProcessor,
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
    RowStateLogitsProcessor,
)
from kvserve.sample.logits_processor.interface import (
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
)
from kvserve.sample.logits_processor.loader import (
    LogitsProcessorSpec,
    load_logits_processor,
    load_logits_processors,
)
from kvserve.sample.logits_processor.state import BatchUpdateBuilder, LogitsProcessors

__all__ = [
    "BUILTIN_LOGITS_PROCESSORS",
    "AllowedTokenIdsLogitsProcessor",
    "BadWordsLogitsProcessor",
    "BatchUpdate",
    "BatchUpdateBuilder",
    "LogitBiasLogitsProcessor",
    "LogitsProcessor",
    "LogitsProcessorSpec",
    "LogitsProcessors",
    "MinPLogitsProcessor",
    "MinTokensLogitsProcessor",
    "MoveDirectionality",
    "RowStateLogitsProcessor",
    "load_logits_processor",
    "load_logits_processors",
]
