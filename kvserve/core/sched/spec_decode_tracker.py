"""The scheduler's side of speculative decoding (vLLM's unified compute model).

A request's drafts (``Request.spec_token_ids``) are just more tokens to compute: a running
request is scheduled up to ``num_tokens_with_spec``, and the drafts that fit the step go
out in ``SchedulerOutput.scheduled_spec_decode_tokens``. The step counts every scheduled
token as computed; ``update_from_output`` then rolls ``num_computed_tokens`` back by the
rejected drafts, so their KV slots are simply overwritten by the next step. They are never
cached as prefix blocks: ``allocate_slots`` hashes at most ``request.num_tokens`` tokens,
and drafts are not part of those.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from kvserve.protocol.engine_core import SpecDecodingStats

if TYPE_CHECKING:
    from kvserve.config import SpeculativeConfig
    from kvserve.core.request import Request


class SpecDecodeTracker:
    """Owns the acceptance totals; reads and writes only the requests it is handed."""

    def __init__(self, spec: SpeculativeConfig | None, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.num_spec_tokens = 0 if spec is None else spec.num_speculative_tokens or 0
        # Slots past the step's tokens that the drafter writes KV into (draft models).
        self.num_lookahead_tokens = 0 if spec is None else spec.num_lookahead_slots
        self.spec_decoding_stats: SpecDecodingStats | None = (
            None
            if spec is None
            else SpecDecodingStats(
                num_spec_tokens=self.num_spec_tokens,
                num_accepted_tokens_per_pos=[0] * self.num_spec_tokens,
            )
        )

    def scheduled_drafts(self, request: Request, num_new_tokens: int) -> list[int]:
        """The drafts among a running request's num_new_tokens (the budget may cut some)."""
        num_spec = num_new_tokens + request.num_computed_tokens - request.num_tokens
        if num_spec <= 0:
            return []
        return request.spec_token_ids[:num_spec]

    def apply_result(self, request: Request, scheduled_spec: list[int], num_generated: int) -> None:
        """Rolls back the rejected drafts of a verified step and counts the acceptance.

        ``num_generated`` tokens came out: the accepted drafts plus one (0 when the step's
        output was lost, e.g. the request was voided: then every draft counts as rejected).
        """
        request.spec_token_ids = []
        num_accepted = max(num_generated - 1, 0)
        num_rejected = len(scheduled_spec) - num_accepted
        request.num_computed_tokens -= num_rejected
        stats = self.spec_decoding_stats
        if stats is None or not num_generated:
            return
        stats.num_drafts += 1
        stats.num_draft_tokens += len(scheduled_spec)
        stats.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            stats.num_accepted_tokens_per_pos[pos] += 1

    def keep_drafts(self, request: Request, draft_token_ids: list[int]) -> None:
        """Keeps the drafts the next step can use: none past max_tokens or max_model_len
        (the step adds one token of its own), and none across the min_tokens boundary,
        where the stop-token mask changes from one position to the next. A request under a
        grammar keeps the drafts its matcher accepts (checked, then rolled back): the step
        masks every draft position with the grammar's state after the drafts before it."""
        limit = self.max_model_len - request.num_tokens - 1
        if request.max_tokens is not None:
            limit = min(limit, request.max_tokens - request.num_output_tokens - 1)
        min_tokens = request.sampling_params.min_tokens
        if request.num_output_tokens < min_tokens:
            limit = min(limit, min_tokens - request.num_output_tokens - 1)
        drafts = draft_token_ids[: max(limit, 0)]
        constrained = request.structured_output_request
        if constrained is not None and drafts:
            # Drafts up to a thinking model's think-end token are free reasoning.
            gate = constrained.reasoning_gate
            free = min(gate.reasoning_positions(drafts), len(drafts)) if gate is not None else 0
            grammar = constrained.grammar
            ok = grammar is not None and not grammar.is_terminated()
            checked = grammar.validate_tokens(drafts[free:]) if grammar is not None and ok else []
            drafts = drafts[:free] + checked
        request.spec_token_ids = drafts

    def make_stats(self) -> SpecDecodingStats | None:
        """A copy of the totals for SchedulerStats (the live ones keep counting)."""
        stats = self.spec_decoding_stats
        if stats is None:
            return None
        return msgspec.structs.replace(
            stats, num_accepted_tokens_per_pos=list(stats.num_accepted_tokens_per_pos)
        )
