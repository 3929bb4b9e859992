"""DeepSeek-R1: ``<think>reasoning</think>answer``; its template may put ``<think>`` in the
prompt, so the output starts inside the reasoning, and all of an output without
``</think>`` is reasoning (cut short before the answer)."""

from __future__ import annotations

from kvserve.entrypoints.openai.reasoning_parsers.abs_reasoning_parsers import (
    ReasoningParserManager,
)
from kvserve.entrypoints.openai.reasoning_parsers.think_parser import ThinkingReasoningParser


@ReasoningParserManager.register_module("deepseek_r1")
class DeepSeekR1ReasoningParser(ThinkingReasoningParser):
    implicit_reasoning = True
