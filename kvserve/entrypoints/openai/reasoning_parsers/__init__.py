"""Reasoning parsers, chosen by ``--reasoning-parser``; importing the package registers the
built-in ones (deepseek_r1, qwen3). ``auto`` picks one from the chat template."""

from __future__ import annotations

import logging
from typing import Any

from kvserve.entrypoints.openai.reasoning_parsers.abs_reasoning_parsers import (
    ReasoningParser,
    ReasoningParserManager,
    ReasoningStreamer,
)
from kvserve.entrypoints.openai.reasoning_parsers.deepseek_r1_reasoning_parser import (
    DeepSeekR1ReasoningParser,
)
from kvserve.entrypoints.openai.reasoning_parsers.qwen3_reasoning_parser import (
    Qwen3ReasoningParser,
)
from kvserve.entrypoints.openai.reasoning_parsers.think_parser import ThinkingReasoningParser

logger = logging.getLogger(__name__)


def auto_reasoning_parser(tokenizer: Any, chat_template: str | None) -> str | None:
    """The parser for a model whose chat template writes ``<think>``/``</think>`` and whose
    tokenizer has them as single tokens; None otherwise (the output is all content).
    A template with Qwen3's ``enable_thinking`` switch gets qwen3, others deepseek_r1."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    tags = (ThinkingReasoningParser.start_token, ThinkingReasoningParser.end_token)
    if not isinstance(template, str) or tokenizer is None:
        return None
    vocab = tokenizer.get_vocab()
    if not all(tag in template and tag in vocab for tag in tags):
        return None
    name = "qwen3" if "enable_thinking" in template else "deepseek_r1"
    logger.info("--reasoning-parser auto: the chat template thinks in <think> tags: %s", name)
    return name


def make_reasoning_parser(
    name: str | None, tokenizer: Any, chat_template: str | None
) -> ReasoningParser | None:
    """The server's parser for ``--reasoning-parser NAME`` (None: no reasoning output)."""
    if name == "auto":
        name = auto_reasoning_parser(tokenizer, chat_template)
    if not name:
        return None
    return ReasoningParserManager.get_reasoning_parser(name)(tokenizer)


__all__ = [
    "DeepSeekR1ReasoningParser",
    "Qwen3ReasoningParser",
    "ReasoningParser",
    "ReasoningParserManager",
    "ReasoningStreamer",
    "ThinkingReasoningParser",
    "auto_reasoning_parser",
    "make_reasoning_parser",
]
