"""The engine core's view of one request's grammar: compiling, ready, or failed."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured_output.reasoning_gate import ReasoningGate

if TYPE_CHECKING:
    from kvserve.structured_output.backend_types import StructuredOutputGrammar


class StructuredOutputRequest:
    """Holds the compile future until it resolves, then the request's own matcher.

    Pure Python (no grammar library import), so the scheduler can ask it questions.
    """

    def __init__(
        self, params: StructuredOutputsParams, prompt_token_ids: Sequence[int] = ()
    ) -> None:
        self.params = params
        # A thinking model's request: the grammar waits for the reasoning to end.
        self.reasoning_gate = (
            ReasoningGate(params._reasoning, prompt_token_ids)
            if params._reasoning is not None
            else None
        )
        self._future: Future[StructuredOutputGrammar] | None = None
        self._grammar: StructuredOutputGrammar | None = None
        self._error: str | None = None

    def set_future(self, future: Future[StructuredOutputGrammar]) -> None:
        self._future = future

    def _resolve(self) -> None:
        future = self._future
        if future is None or not future.done():
            return
        self._future = None
        error = future.exception()
        if error is None:
            self._grammar = future.result()
        else:
            self._error = f"the {self.params.kind} grammar failed to compile: {error}"

    @property
    def grammar(self) -> StructuredOutputGrammar | None:
        """The matcher once compiled; None while compiling or after a failure."""
        self._resolve()
        return self._grammar

    @property
    def error(self) -> str | None:
        """Why the grammar could not be compiled (None while compiling or when it was)."""
        self._resolve()
        return self._error

    def is_ready(self) -> bool:
        """Compiled or failed: the scheduler can decide about the request."""
        self._resolve()
        return self._grammar is not None or self._error is not None
