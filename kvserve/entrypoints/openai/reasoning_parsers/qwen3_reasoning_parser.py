"""Qwen3: ``<think>reasoning</think>answer`` when the model thinks; an output that does not
open ``<think>`` is all content, and ``chat_template_kwargs={"enable_thinking": false}``
closes the reasoning in the prompt (no reasoning at all). A template that opens
``<think>`` itself (Qwen3-2507 thinking) starts the output inside the reasoning."""

from __future__ import annotations

from kvserve.entrypoints.openai.reasoning_parsers.abs_reasoning_parsers import (
    ReasoningParserManager,
)
from kvserve.entrypoints.openai.reasoning_parsers.think_parser import ThinkingReasoningParser


@ReasoningParserManager.register_module("qwen3")
class Qwen3ReasoningParser(ThinkingReasoningParser):
    implicit_reasoning = False
