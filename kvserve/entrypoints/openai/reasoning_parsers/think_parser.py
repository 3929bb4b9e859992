"""The ``<think>...</think>`` format that DeepSeek-R1 and Qwen3 share (vLLM's
BaseThinkingReasoningParser), split on the tags' text: a tag cut over several tokens (or
several stream deltas) is found all the same and never reaches the content."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, ClassVar

from kvserve.entrypoints.openai.reasoning_parsers.abs_reasoning_parsers import (
    ReasoningParser,
    ReasoningStreamer,
)
from kvserve.sampling_params import ReasoningTokens


class _Part(enum.Enum):
    START = enum.auto()  # nothing decided yet: the output may open with the start tag
    REASONING = enum.auto()
    CONTENT = enum.auto()


class ThinkStreamer(ReasoningStreamer):
    def __init__(self, start_tag: str, end_tag: str, part: _Part, implicit: bool) -> None:
        self.start_tag = start_tag
        self.end_tag = end_tag
        self.part = part
        # Whether output that does not open with the start tag is reasoning.
        self.implicit = implicit
        self.held = ""

    def feed(self, delta: str, finished: bool) -> tuple[str, str]:
        text, self.held = self.held + delta, ""
        reasoning = ""
        while True:
            if self.part is _Part.START:
                if text.startswith(self.start_tag):
                    text = text[len(self.start_tag) :]
                    self.part = _Part.REASONING
                elif self.start_tag.startswith(text) and not finished:
                    self.held = text
                    return reasoning, ""
                else:
                    self.part = _Part.REASONING if self.implicit else _Part.CONTENT
            elif self.part is _Part.REASONING:
                end = text.find(self.end_tag)
                if end >= 0:
                    reasoning += text[:end]
                    text = text[end + len(self.end_tag) :]
                    self.part = _Part.CONTENT
                    continue
                keep = 0 if finished else _partial_tag(text, self.end_tag)
                self.held = text[len(text) - keep :]
                return reasoning + text[: len(text) - keep], ""
            else:
                return reasoning, text


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (but is not all of it)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ThinkingReasoningParser(ReasoningParser):
    start_token: ClassVar[str] = "<think>"
    end_token: ClassVar[str] = "</think>"
    # Output that does not open with <think> is reasoning (DeepSeek-R1, whose template may
    # open it) or content (Qwen3, which thinks only when it opens the tag itself).
    implicit_reasoning: ClassVar[bool] = False

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        vocab = self.vocab if tokenizer is not None else {}
        # None where the tag is several tokens (a model not trained with it).
        self.start_token_id: int | None = vocab.get(self.start_token)
        self.end_token_id: int | None = vocab.get(self.end_token)

    def _last_tag(self, prompt: str) -> str | None:
        start, end = prompt.rfind(self.start_token), prompt.rfind(self.end_token)
        if start < 0 and end < 0:
            return None
        return self.end_token if end > start else self.start_token

    def streamer(self, prompt: str) -> ThinkStreamer:
        last = self._last_tag(prompt)
        if last == self.end_token:  # the template closed it: thinking is off
            return ThinkStreamer(self.start_token, self.end_token, _Part.CONTENT, False)
        implicit = self.implicit_reasoning or last == self.start_token
        return ThinkStreamer(self.start_token, self.end_token, _Part.START, implicit)

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        for token in reversed(input_ids):
            if token == self.end_token_id:
                return True
            if token == self.start_token_id:
                return False
        return False

    def extract_content_ids(self, input_ids: Sequence[int]) -> list[int]:
        ids = list(input_ids)
        if self.end_token_id not in ids:
            return [] if self.implicit_reasoning else ids
        return ids[ids.index(self.end_token_id) + 1 :]

    def reasoning_tokens(self) -> ReasoningTokens | None:
        if self.start_token_id is None or self.end_token_id is None:
            return None
        return ReasoningTokens(
            start_token_ids=[self.start_token_id], end_token_ids=[self.end_token_id]
        )

    def adjust_skip_special_tokens(self, skip_special_tokens: bool) -> bool:
        special = set(getattr(self.model_tokenizer, "all_special_ids", ()))
        if {self.start_token_id, self.end_token_id} & special:
            return False  # tags added as special tokens would be dropped from the text
        return skip_special_tokens
