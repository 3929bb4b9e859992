"""A thinking model's grammar starts after its think-end token: the gate's bookkeeping,
the step's bitmask rows (with drafts), and rollback, on the real tokenizer and xgrammar."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvserve.core.request import Request
from kvserve.core.sched.grammar_tracker import GrammarTracker
from kvserve.protocol.scheduler_output import SchedulerOutput
from kvserve.sampling_params import ReasoningTokens, SamplingParams, StructuredOutputsParams
from kvserve.structured_output import StructuredOutputManager
from kvserve.structured_output.reasoning_gate import ReasoningGate

VOCAB = 49152
START, END = 100, 101  # stand-ins for <think> and </think>: the gate compares ids only
THINK = ReasoningTokens(start_token_ids=[START], end_token_ids=[END])
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.fixture
def manager(tokenizer: Any) -> Any:
    manager = StructuredOutputManager("xgrammar", VOCAB, 4, load_tokenizer=lambda: tokenizer)
    yield manager
    manager.shutdown()


def test_gate_bookkeeping() -> None:
    assert ReasoningGate(THINK, [1, END, 2]).reasoning_ended  # thinking off in the template
    assert not ReasoningGate(THINK, [END, 5, START]).reasoning_ended  # template opened it
    gate = ReasoningGate(THINK, [])
    assert gate.reasoning_positions([7, END, 8]) == 2  # the next token and the one after 7
    assert gate.reasoning_positions([7, 8]) == 3  # all of the step
    assert not gate.takes(7, 1) and not gate.takes(END, 2)
    assert gate.takes(8, 3) and gate.grammar_start == 2
    assert gate.reasoning_positions([END]) == 0
    assert gate.truncate(5, 3) == 2  # output 3, 4 were the grammar's
    assert gate.truncate(3, 1) == 1 and not gate.reasoning_ended  # the end token went too


def allowed(row: np.ndarray) -> set[int]:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    return {int(t) for t in np.flatnonzero(bits[:VOCAB])}


def test_grammar_masks_only_after_the_end_token(manager: Any, tokenizer: Any) -> None:
    spec = StructuredOutputsParams(json=SCHEMA, _backend="xgrammar", _reasoning=THINK)
    request = Request("r", [1, 2, START], SamplingParams(structured_outputs=spec), None)
    so_request = request.structured_output_request
    assert so_request is not None and so_request.reasoning_gate is not None
    manager.grammar_init(so_request)
    so_request._future.result(timeout=60)  # type: ignore[union-attr]
    grammar = so_request.grammar
    request.num_computed_tokens = request.num_tokens
    tracker = GrammarTracker(manager)
    brace = tokenizer.encode("{", add_special_tokens=False)
    step = SchedulerOutput.empty()
    step.num_scheduled_tokens["r"] = 1
    assert tracker.bitmask(step, {"r": request}) is None  # reasoning: nothing to mask
    # A speculative step whose drafts end the reasoning: rows up to the end token free,
    # then the grammar's masks from its start.
    step.scheduled_spec_decode_tokens["r"] = [7, END, *brace]
    out = tracker.bitmask(step, {"r": request})
    assert out is not None and out.structured_output_request_ids == ["r"] * 4
    assert (out.grammar_bitmask[:2] == -1).all()
    assert allowed(out.grammar_bitmask[2]) == allowed(manager.grammar_bitmask([grammar])[0])
    assert '"' in {tokenizer.decode([t]).strip() for t in allowed(out.grammar_bitmask[3])}
    # The tokens come: reasoning ones pass the grammar by; the answer is its.
    for token in [7, 8, END, *brace]:
        request.append_output_token_ids(token)
        assert not tracker.advance(request, token)
    assert so_request.reasoning_gate.grammar_start == 3
    assert grammar is not None and grammar.num_processed_tokens == len(brace)
    # A failed step's tokens rolled back past the end token: reasoning again, grammar empty.
    request.truncate_output_token_ids(2, block_size=16)
    assert grammar.num_processed_tokens == 0 and not so_request.reasoning_gate.reasoning_ended
