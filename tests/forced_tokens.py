"""A logits processor that makes a request emit a given token sequence, for tests of what the
server does with a model's output (tool call parsers, reasoning parsers, agents' loops) on
models too small to produce that output themselves.

Loaded as a user's processor is (`--logits-processors tests.forced_tokens:FORCED_TOKENS`)
and turned on per request: `vllm_xargs={"forced_token_ids": "12,7,99,2"}` (a comma-separated
string: vllm_xargs values are scalars). Output token i is ids[i]; past the end the row is
free. End the list with the EOS id for a "stop" finish.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.sample.logits_processor import RowStateLogitsProcessor
from kvserve.sampling_params import SamplingParams

FORCED_TOKENS = "tests.forced_tokens:ForcedTokensLogitsProcessor"
XARG = "forced_token_ids"


def forced_xargs(token_ids: Sequence[int]) -> dict[str, str]:
    """The request's vllm_xargs that force ``token_ids``."""
    return {XARG: ",".join(str(t) for t in token_ids)}


class ForcedTokensLogitsProcessor(RowStateLogitsProcessor[tuple[list[int], list[int]]]):
    """State per row: (ids to emit, the row's live output list)."""

    def new_state(
        self, params: SamplingParams, prompt: list[int], output: list[int]
    ) -> tuple[list[int], list[int]] | None:
        spec = (params.extra_args or {}).get(XARG)
        if spec is None:
            return None
        return [int(t) for t in str(spec).split(",") if t.strip()], output

    def is_argmax_invariant(self) -> bool:
        return False  # it decides greedy rows too

    def apply_to(self, logits: torch.Tensor) -> torch.Tensor:
        for row, (ids, output) in self.states.items():
            if len(output) < len(ids):
                token = ids[len(output)]
                logits[row] = float("-inf")
                logits[row, token] = 0.0
        return logits
