"""CacheBlend's token selection for one step: after the check layer, which tokens the
remaining layers recompute.

The step's cached-segment tokens carry KV loaded from the tier (moved to their new
positions); the layers up to the check layer computed every token afresh, so the check
layer's cache now holds fresh K/V where the loaded copy was. The tokens whose fresh K/V
deviate most from the loaded ones (squared L2 over keys and values, LMCache's rule) are
recomputed, ``ceil(ratio * n)`` per request; every token outside a cached segment (the
separators, uncached segments, the query) always is. The others keep the loaded KV in
the later layers, which the kept tokens attend to through the paged cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from kvserve.distributed.parallel_state import GroupCoordinator
from kvserve.forward_context import ForwardContext, TokenSelector


@dataclass
class CachedTokens:
    """One blended request's tokens whose KV came from the tier."""

    rows: torch.Tensor  # int64 [n]: the tokens' rows in the step's batch
    slots: torch.Tensor  # int64 [n]: their cache slots
    loaded: torch.Tensor  # [2, n, kv heads, head size]: the check layer's loaded K/V
    recompute_ratio: float


class BlendSelection(TokenSelector):
    def __init__(
        self,
        context: ForwardContext,
        check_layer: int,
        check_cache: torch.Tensor,
        cached: list[CachedTokens],
        num_tokens: int,
        tp_group: GroupCoordinator,
    ) -> None:
        self.check_layer = check_layer
        self._context = context
        self._check_cache = check_cache
        self._cached = cached
        self._num_tokens = num_tokens  # the step's real tokens (the batch may be padded)
        self._kept: torch.Tensor | None = None
        self._num_rows = 0
        self._tp_group = tp_group  # each rank's deviation covers its own KV heads
        self.num_recomputed = 0  # cached tokens chosen for recompute in this step
        self.num_reused = 0

    def select(
        self, hidden_states: torch.Tensor, residual: Any, positions: torch.Tensor
    ) -> tuple[torch.Tensor, Any, torch.Tensor]:
        rows = hidden_states.shape[0]
        keep = torch.zeros(rows, dtype=torch.bool, device=hidden_states.device)
        keep[: self._num_tokens] = True
        cache = self._check_cache
        flat = cache.view(2, -1, *cache.shape[-2:])
        for group in self._cached:
            fresh = flat[:, group.slots].float()
            deviation = (fresh - group.loaded.float()).square().sum(dim=(0, 2, 3))
            deviation = self._tp_group.all_reduce(deviation)
            count = math.ceil(group.recompute_ratio * group.rows.shape[0])
            keep[group.rows] = False
            if count:
                keep[group.rows[deviation.topk(count).indices]] = True
            self.num_recomputed += count
            self.num_reused += group.rows.shape[0] - count
        if bool(keep.all()):
            return hidden_states, residual, positions
        kept = torch.nonzero(keep).flatten()
        self._kept, self._num_rows = kept, rows
        self._context.attn_metadata = self._context.attn_metadata.select_tokens(kept)
        return (
            hidden_states[kept],
            None if residual is None else residual[kept],
            positions[kept],
        )

    def restore(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The kept rows at their places; the others are zeros (no sampling row is
        dropped: a request's last token is never in a cached segment)."""
        if self._kept is None:
            return hidden_states
        out = hidden_states.new_zeros((self._num_rows, *hidden_states.shape[1:]))
        out[self._kept] = hidden_states
        return out
