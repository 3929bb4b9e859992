"""A logits processor that makes a request emit a given token sequence, for tests of what the
server does with a model's output (tool call parsers, reasoning parsers, agents' loops) on
models too small to produce that output themselves.

Loaded as a user's processor is (`--logits-processors tests.forced_tokens:FORCED_TOKENS`)
and turned on per request: `vllm_xargs={"forced_token_ids": "12,7,99,2"}` (a comma-separated
string: vllm_xargs values are scalars). Output token i is ids[i]; past the end the row is
free. End the list with the EOS id for a "stop" finish.

An agent's turns come from one client setting (pydantic-ai sends the same extra_body on
every request of a run), so a second list may replace the first once the conversation
has moved on: ``forced_xargs(call_ids, then=answer_ids, after=marker_ids)`` forces
``answer_ids`` when the prompt holds the token sequence ``marker_ids`` (a tool result's
tag, say) and ``call_ids`` until then.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.sample.logits_processor import RowStateLogitsProcessor
from kvserve.sampling_params import SamplingParams

FORCED_TOKENS = "tests.forced_tokens:ForcedTokensLogitsProcessor"
XARG = "forced_token_ids"
XARG_THEN = "forced_token_ids_then"
XARG_AFTER = "forced_after_prompt_has"


def forced_xargs(
    token_ids: Sequence[int], then: Sequence[int] = (), after: Sequence[int] = ()
) -> dict[str, str]:
    """The request's vllm_xargs that force ``token_ids``, or ``then`` once the prompt
    contains ``after``."""
    xargs = {XARG: _ids(token_ids)}
    if then:
        xargs |= {XARG_THEN: _ids(then), XARG_AFTER: _ids(after)}
    return xargs


def _ids(token_ids: Sequence[int]) -> str:
    return ",".join(str(t) for t in token_ids)


def _parse(spec: object) -> list[int]:
    return [int(t) for t in str(spec).split(",") if t.strip()]


def _contains(prompt: list[int], marker: list[int]) -> bool:
    return any(prompt[i : i + len(marker)] == marker for i in range(len(prompt) - len(marker) + 1))


class ForcedTokensLogitsProcessor(RowStateLogitsProcessor[tuple[list[int], list[int]]]):
    """State per row: (ids to emit, the row's live output list)."""

    def new_state(
        self, params: SamplingParams, prompt: list[int], output: list[int]
    ) -> tuple[list[int], list[int]] | None:
        args = params.extra_args or {}
        if XARG not in args:
            return None
        if XARG_THEN in args and _contains(prompt, _parse(args.get(XARG_AFTER, ""))):
            return _parse(args[XARG_THEN]), output
        return _parse(args[XARG]), output

    def is_argmax_invariant(self) -> bool:
        return False  # it decides greedy rows too

    def apply_to(self, logits: torch.Tensor) -> torch.Tensor:
        for row, (ids, output) in self.states.items():
            if len(output) < len(ids):
                token = ids[len(output)]
                logits[row] = float("-inf")
                logits[row, token] = 0.0
        return logits
