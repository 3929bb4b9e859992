"""The scheduler's side of structured outputs: holding requests while their grammar
compiles, the step's bitmask, and advancing matchers with the sampled tokens.

Request life with a grammar:
  WAITING_FOR_FSM (compiling on the manager's threads; others run past it) -> WAITING once
  the grammar is ready, or FINISHED_ERROR if it failed to compile -> RUNNING; each token it
  samples is masked by its matcher, accepted into it, and the grammar's completion ends it.
  A thinking model's request (its params name the think tokens) samples freely until its
  think-end token; the grammar starts with the token after (ReasoningGate).
Preemption keeps the matcher: the request recomputes its tokens, not its grammar state.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from kvserve.core.request import Request, RequestStatus
from kvserve.protocol.scheduler_output import GrammarOutput, SchedulerOutput

if TYPE_CHECKING:
    from kvserve.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class GrammarTracker:
    """Reads the requests' matchers; owns nothing but the manager it asks for bitmasks."""

    def __init__(self, manager: StructuredOutputManager | None) -> None:
        self.structured_output_manager = manager

    @staticmethod
    def grammar_ready(request: Request) -> tuple[bool, str | None]:
        """For a WAITING_FOR_FSM request: (True, None) once its grammar compiled (it is
        WAITING now), (False, error) when the compile failed: the caller ends it."""
        so_request = request.structured_output_request
        if so_request is None or not so_request.is_ready():
            return False, None
        if so_request.error is not None:
            return False, so_request.error
        request.status = RequestStatus.WAITING
        return True, None

    def bitmask(
        self, scheduler_output: SchedulerOutput, requests: Mapping[str, Request]
    ) -> GrammarOutput | None:
        """The bitmask rows of the constrained requests that sample in this step (call it
        after schedule(), before the step's tokens are sampled); None when there are none."""
        if self.structured_output_manager is None:
            return None
        req_ids: list[str] = []
        grammars = []
        drafts: list[list[int]] = []
        free_rows: list[int] = []
        for req_id in scheduler_output.num_scheduled_tokens:
            request = requests.get(req_id)
            so_request = request.structured_output_request if request is not None else None
            if request is None or so_request is None:
                continue
            grammar = so_request.grammar
            # schedule() counted the step's tokens as computed: caught up means it samples.
            if grammar is None or request.num_computed_tokens < request.num_tokens:
                continue
            # One row per position it samples: the next token and one after each draft.
            spec = scheduler_output.scheduled_spec_decode_tokens.get(req_id, [])
            gate = so_request.reasoning_gate
            free = gate.reasoning_positions(spec) if gate is not None else 0
            if free == 1 + len(spec):
                continue  # reasoning through the whole step: nothing to mask
            req_ids += [req_id] * (1 + len(spec))
            grammars.append(grammar)
            drafts.append(list(spec))
            free_rows.append(free)
        if not req_ids:
            return None
        bitmask = self.structured_output_manager.grammar_bitmask(grammars, drafts, free_rows)
        return GrammarOutput(req_ids, bitmask)

    @staticmethod
    def advance(request: Request, token_id: int) -> bool:
        """Feeds a sampled token to the request's matcher; True when the grammar completed
        (the request then stops like on EOS)."""
        so_request = request.structured_output_request
        grammar = so_request.grammar if so_request is not None else None
        if grammar is None:
            return False
        assert so_request is not None
        gate = so_request.reasoning_gate
        if gate is not None and not gate.takes(token_id, request.num_output_tokens):
            return False  # reasoning (or its end token): free text, not the grammar's
        if not grammar.accept_tokens(request.request_id, [token_id]):
            # Only possible when the token was sampled without the mask (a bug): say so, and
            # let the length cap or EOS end the request.
            logger.error(
                "request %s: token %d rejected by its grammar", request.request_id, token_id
            )
            return False
        if grammar.is_terminated():
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        return False
