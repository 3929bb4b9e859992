"""ReasoningParser: splits a thinking model's output into its reasoning and its answer
(``reasoning_content`` / ``content``); ReasoningParserManager: the registry behind
``--reasoning-parser``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from kvserve.sampling_params import ReasoningTokens


class ReasoningStreamer(ABC):
    """One choice's output as it streams: ``feed`` each text delta, get (reasoning, content)."""

    @abstractmethod
    def feed(self, delta: str, finished: bool) -> tuple[str, str]:
        """The reasoning and content text this delta completes (text that may still turn
        out to be part of a tag is held back until the next delta, or the end)."""


class ReasoningParser(ABC):
    """Parses one model's reasoning format. ``prompt`` is the templated prompt text: the
    template may have opened the reasoning already, or closed it (thinking switched off)."""

    name: ClassVar[str] = ""

    def __init__(self, tokenizer: Any) -> None:
        self.model_tokenizer = tokenizer

    @property
    def vocab(self) -> dict[str, int]:
        return dict(self.model_tokenizer.get_vocab())

    @abstractmethod
    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        """Whether the reasoning has ended by the end of ``input_ids``."""

    @abstractmethod
    def extract_content_ids(self, input_ids: Sequence[int]) -> list[int]:
        """The ids of the content part of a finished output."""

    @abstractmethod
    def streamer(self, prompt: str) -> ReasoningStreamer:
        """A fresh splitter for one output of ``prompt``."""

    def extract_reasoning_content(
        self, model_output: str, prompt: str = ""
    ) -> tuple[str | None, str | None]:
        """(reasoning, content) of a finished output, None for a part that is empty:
        the same split its stream gives."""
        reasoning, content = self.streamer(prompt).feed(model_output, finished=True)
        return reasoning or None, content or None

    def reasoning_tokens(self) -> ReasoningTokens | None:
        """The think tokens, when each is one token: the engine then applies a request's
        grammar only after the reasoning (None: a grammar constrains the whole output)."""
        return None

    def adjust_skip_special_tokens(self, skip_special_tokens: bool) -> bool:
        """The detokenizer setting the parser needs: its tags must be in the text."""
        return skip_special_tokens


class ReasoningParserManager:
    reasoning_parsers: ClassVar[dict[str, type[ReasoningParser]]] = {}

    @classmethod
    def register_module(cls, name: str) -> Callable[[type[ReasoningParser]], type[ReasoningParser]]:
        def wrap(parser: type[ReasoningParser]) -> type[ReasoningParser]:
            parser.name = name
            cls.reasoning_parsers[name] = parser
            return parser

        return wrap

    @classmethod
    def get_reasoning_parser(cls, name: str) -> type[ReasoningParser]:
        if name not in cls.reasoning_parsers:
            known = ", ".join(["auto", *sorted(cls.reasoning_parsers)])
            raise ValueError(f"reasoning parser {name!r} is unknown; known: {known}")
        return cls.reasoning_parsers[name]
