"""Custom logits processors with the kind of bug a user plugin has, for the failure tests.

Loaded by the engine as a user's would be (`logits_processors=[...]`) and turned on per
request through `SamplingParams.extra_args`; each raises inside the model step.
"""

from __future__ import annotations

import torch

from kvserve.sample.logits_processor import RowStateLogitsProcessor
from kvserve.sampling_params import SamplingParams

FORCE_TOKEN = "tests.engine_core.faulty_logits_processors:ForceTokenLogitsProcessor"
EXCLUSIVE_SLOT = "tests.engine_core.faulty_logits_processors:ExclusiveSlotLogitsProcessor"


class ForceTokenLogitsProcessor(RowStateLogitsProcessor[int]):
    """`extra_args={"force_token_id": t}` makes the request emit t, always.

    The bug: t is never checked against the vocabulary, so an id past it raises an
    IndexError in the middle of the step."""

    def new_state(self, params: SamplingParams, prompt: list[int], output: list[int]) -> int | None:
        token = (params.extra_args or {}).get("force_token_id")
        return None if token is None else int(token)

    def is_argmax_invariant(self) -> bool:
        return False

    def apply_to(self, logits: torch.Tensor) -> torch.Tensor:
        rows = list(self.states)
        tokens = [self.states[r] for r in rows]
        keep = logits[rows, tokens].clone()
        logits[rows] = float("-inf")
        logits[rows, tokens] = keep
        return logits


class ExclusiveSlotLogitsProcessor(RowStateLogitsProcessor[int]):
    """`extra_args={"slot": k}` reserves slot k of some shared resource for the request.

    The bug: it assumes no two requests in a batch ask for the same slot, and raises when
    they do: the failure belongs to no single request, only to the pair."""

    def new_state(self, params: SamplingParams, prompt: list[int], output: list[int]) -> int | None:
        slot = (params.extra_args or {}).get("slot")
        return None if slot is None else int(slot)

    def is_argmax_invariant(self) -> bool:
        return False  # so that it runs for greedy requests too

    def apply_to(self, logits: torch.Tensor) -> torch.Tensor:
        slots = list(self.states.values())
        if len(set(slots)) < len(slots):
            raise RuntimeError(f"slot clash among rows: {sorted(slots)}")
        return logits
