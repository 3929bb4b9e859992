"""Where a thinking model's reasoning ends in one request's tokens: its grammar constrains
only the tokens after the think-end token (vLLM's ``reasoning_ended``), so the reasoning is
free text and the answer follows the schema.

Pure Python, one writer (the scheduler's GrammarTracker), exact per token: a step with
drafts knows which of its positions are still reasoning, and a rollback of output tokens
undoes only what the grammar took (and reopens the reasoning if the end token went too).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.sampling_params import ReasoningTokens


class ReasoningGate:
    def __init__(self, tokens: ReasoningTokens, prompt_token_ids: Sequence[int]) -> None:
        self.start_ids = frozenset(tokens.start_token_ids)
        self.end_ids = frozenset(tokens.end_token_ids)
        # The output index of the grammar's first token; None while the model reasons. A
        # prompt whose last think token closes the reasoning (thinking switched off by the
        # template) starts the grammar at the first output token.
        self.grammar_start: int | None = 0 if self._ended_in(prompt_token_ids) else None

    def _ended_in(self, token_ids: Sequence[int]) -> bool:
        for token in reversed(token_ids):
            if token in self.end_ids:
                return True
            if token in self.start_ids:
                return False
        return False

    @property
    def reasoning_ended(self) -> bool:
        return self.grammar_start is not None

    def takes(self, token_id: int, num_output_tokens: int) -> bool:
        """Whether the grammar takes output token ``num_output_tokens - 1`` (``token_id``,
        just appended): no while reasoning; the end token itself opens the grammar for the
        next one."""
        if self.grammar_start is not None:
            return True
        if token_id in self.end_ids:
            self.grammar_start = num_output_tokens
        return False

    def reasoning_positions(self, drafts: Sequence[int]) -> int:
        """How many of a step's sampled positions (the next token, then one after each
        draft) are still reasoning: 0 once it ended; all of them (1 + len(drafts)) when no
        draft ends it."""
        if self.grammar_start is not None:
            return 0
        for i, token in enumerate(drafts):
            if token in self.end_ids:
                return i + 1
        return 1 + len(drafts)

    def truncate(self, old_num_output_tokens: int, num_output_tokens: int) -> int:
        """Output tokens drop back to ``num_output_tokens``: how many of the dropped ones
        the grammar had taken (to roll back)."""
        start = self.grammar_start
        if start is None or start > old_num_output_tokens:
            return 0
        if num_output_tokens < start:
            self.grammar_start = None  # the end token itself is gone: reasoning again
        return old_num_output_tokens - max(start, num_output_tokens)
