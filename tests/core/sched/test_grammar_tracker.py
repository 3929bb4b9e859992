"""The scheduler's structured-output side on the real engine: constrained rows leave the
others' tokens alone, a slow compile holds only its own request (counted in steps), and
preemption keeps a request's grammar state."""

from __future__ import annotations

import json
import threading
import uuid
from typing import Any

import jsonschema
import pytest

from kvserve.core.request import RequestStatus
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams
from kvserve.structured_output import register_backend
from kvserve.structured_output.backend_xgrammar import XgrammarBackend
from tests.reference import assert_no_leak

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "population": {"type": "integer", "minimum": 0},
    },
    "required": ["city", "population"],
}
PLAIN_PROMPTS = ["The history of Rome", "def fibonacci(n):", "Once upon a time, a fox"]


@register_backend("gated-xgrammar")
class GatedXgrammarBackend(XgrammarBackend):
    """xgrammar whose compiles wait for the test to open the gate: a compile that takes as
    long as the test wants, so "does not stall" is counted in engine steps, not seconds."""

    gate = threading.Event()

    def compile(self, params: StructuredOutputsParams) -> Any:
        assert self.gate.wait(timeout=300), "the test never opened the gate"
        return super().compile(params)


def plain() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def constrained(spec: dict[str, Any] | None = None, **kwargs: Any) -> SamplingParams:
    # Compact JSON: free whitespace lets the small model pad until max_tokens.
    so = StructuredOutputsParams(json=spec or SCHEMA, disable_any_whitespace=True, **kwargs)
    return SamplingParams(temperature=0.0, max_tokens=100, structured_outputs=so)


def test_unconstrained_rows_keep_their_tokens_in_a_mixed_batch(llm: Any) -> None:
    alone = llm.generate(PLAIN_PROMPTS, plain(), use_tqdm=False)
    json_prompts = ["A city as JSON:", "Give JSON for a town:", "JSON please:"]
    prompts = [p for pair in zip(PLAIN_PROMPTS, json_prompts, strict=True) for p in pair]
    params = [plain(), constrained()] * len(PLAIN_PROMPTS)
    mixed = llm.generate(prompts, params, use_tqdm=False)
    for before, after in zip(alone, mixed[0::2], strict=True):
        assert after.outputs[0].token_ids == before.outputs[0].token_ids
    for output in mixed[1::2]:
        jsonschema.validate(json.loads(output.outputs[0].text), SCHEMA)
    assert_no_leak(llm)


def test_slow_compile_does_not_stall_other_requests(llm: Any) -> None:
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    # A schema no earlier test compiled, so the gated backend must compile it now.
    spec = {**SCHEMA, "title": uuid.uuid4().hex}
    GatedXgrammarBackend.gate.clear()
    engine.add_request("plain", "The history of Rome", plain())
    engine.add_request("gated", "A city as JSON:", constrained(spec, _backend="gated-xgrammar"))
    steps = 12
    for _ in range(steps):
        engine.step()
    # The plain request ran every step (a prefill, then a token each) while the other
    # waited for its grammar without a token or a KV block.
    assert scheduler.requests["plain"].num_output_tokens == steps
    gated = scheduler.requests["gated"]
    assert gated.status == RequestStatus.WAITING_FOR_FSM
    assert gated.num_output_tokens == 0 and gated.num_computed_tokens == 0
    GatedXgrammarBackend.gate.set()
    outputs: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output
    assert len(outputs["plain"].outputs[0].token_ids) == 24
    jsonschema.validate(json.loads(outputs["gated"].outputs[0].text), spec)
    assert_no_leak(llm)


# Thirty digits: long enough outputs (~66 tokens) that six requests outgrow a small pool.
DIGITS = {
    "type": "object",
    "properties": {
        "values": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "minItems": 30,
            "maxItems": 30,
        }
    },
    "required": ["values"],
}


def test_preemption_keeps_the_grammar_state(llm: Any, llm_factory: Any) -> None:
    prompts = [f"List thirty digits for lottery number {i} as JSON." for i in range(6)]
    alone = [llm.generate([p], constrained(DIGITS), use_tqdm=False)[0] for p in prompts]
    # 14 usable blocks of 16 tokens cannot hold the six requests at full length.
    small = llm_factory(num_blocks_override=15, max_num_batched_tokens=64)
    scheduler = small.llm_engine.engine_core.engine_core.scheduler
    before = scheduler.num_preemptions
    together = small.generate(prompts, constrained(DIGITS), use_tqdm=False)
    assert scheduler.num_preemptions > before
    for a, b in zip(alone, together, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        jsonschema.validate(json.loads(b.outputs[0].text), DIGITS)
    assert_no_leak(small)
