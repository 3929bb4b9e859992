"""Reasoning output for one chat request: the thinking model's text split into
``reasoning_content`` and ``content`` (before tool calls are read from the content), and
its grammar (response_format, tool_choice) applied after the reasoning only."""

from __future__ import annotations

import msgspec

from kvserve.entrypoints.openai.reasoning_parsers import ReasoningParser, ReasoningStreamer
from kvserve.sampling_params import SamplingParams


class ChatReasoningHandler:
    """``parser`` None (no --reasoning-parser, or auto found no think tags): every method is
    the identity, all output is content."""

    def __init__(self, parser: ReasoningParser | None, prompt: str, include: bool) -> None:
        self.parser = parser
        self.prompt = prompt
        # include_reasoning=false: the reasoning is still split off, then dropped.
        self.include = include

    def sampling_params(self, params: SamplingParams) -> SamplingParams:
        """``params`` with what the parser needs: its tags in the text, and the grammar
        waiting for the reasoning's end."""
        if self.parser is None:
            return params
        changes: dict[str, object] = {}
        skip = self.parser.adjust_skip_special_tokens(params.skip_special_tokens)
        if skip != params.skip_special_tokens:
            changes["skip_special_tokens"] = skip
        tokens = self.parser.reasoning_tokens()
        if params.structured_outputs is not None and tokens is not None:
            changes["structured_outputs"] = msgspec.structs.replace(
                params.structured_outputs, _reasoning=tokens
            )
        return params.clone(**changes) if changes else params

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning, content) of a finished output."""
        if self.parser is None:
            return None, text
        reasoning, content = self.parser.extract_reasoning_content(text, self.prompt)
        return (reasoning if self.include else None), content or ""

    def streamer(self) -> ChoiceReasoningStreamer:
        return ChoiceReasoningStreamer(
            self.parser.streamer(self.prompt) if self.parser is not None else None, self.include
        )


class ChoiceReasoningStreamer:
    """One choice's stream: ``feed`` each text delta first, get (reasoning, content)."""

    def __init__(self, streamer: ReasoningStreamer | None, include: bool) -> None:
        self.streamer = streamer
        self.include = include

    def feed(self, delta: str, finished: bool) -> tuple[str, str]:
        if self.streamer is None:
            return "", delta
        reasoning, content = self.streamer.feed(delta, finished)
        return (reasoning if self.include else ""), content
