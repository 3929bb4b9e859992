"""Where dual batch overlap cuts a step: two micro-batches of whole requests (vLLM's
UBatchSlice), with about half the step's tokens each.

A step is cut only when it is big enough to pay for the second forward's fixed costs
(``dbo_decode_token_threshold`` tokens for a decode-only step, the prefill threshold
for a step with a prefill chunk) and has two requests at least. Cutting between requests
keeps every request's attention inside one micro-batch; a step of one long prefill and
a few decodes is then cut unevenly, which costs overlap, never correctness.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.attention.backends.utils import CommonAttentionMetadata


@dataclass(frozen=True)
class UBatchSlice:
    """A micro-batch: rows ``request_slice`` of the step and their tokens."""

    request_slice: slice
    token_slice: slice

    @property
    def num_tokens(self) -> int:
        return self.token_slice.stop - self.token_slice.start


def create_ubatch_slices(
    query_start_loc: np.ndarray, decode_threshold: int, prefill_threshold: int
) -> list[UBatchSlice] | None:
    """Two micro-batches cut at the request boundary nearest half the step's tokens, or
    None when the step stays whole. ``query_start_loc``: [num_reqs + 1] token offsets."""
    num_reqs = len(query_start_loc) - 1
    if num_reqs < 2:
        return None
    total = int(query_start_loc[-1])
    has_prefill = total > num_reqs  # some request has more than one query token
    if total < (prefill_threshold if has_prefill else decode_threshold):
        return None
    inner = query_start_loc[1:-1].astype(np.int64)  # the boundaries that leave both non-empty
    cut = 1 + int(np.argmin(np.abs(2 * inner - total)))
    tokens = int(query_start_loc[cut])
    return [
        UBatchSlice(slice(0, cut), slice(0, tokens)),
        UBatchSlice(slice(cut, num_reqs), slice(tokens, total)),
    ]


def reads_later_writes(
    commons: Sequence[CommonAttentionMetadata],
    block_sizes: Sequence[int],
    slices: Sequence[UBatchSlice],
) -> bool:
    """Whether a request of an earlier micro-batch attends to a block that a later
    micro-batch writes in this step (a prefix hit on a block another request of the same
    step computes). Each layer runs the earlier micro-batch first, so the later one may
    read the earlier one's writes but not the other way round: such a step stays whole."""
    for common, block_size in zip(commons, block_sizes, strict=True):
        computed = _np(common.num_computed_tokens_cpu)
        table = _np(common.block_table_tensor)
        slots = _np(common.slot_mapping)
        for i, earlier in enumerate(slices[:-1]):
            rows = earlier.request_slice
            num_blocks = -(-computed[rows].astype(np.int64) // block_size)
            if not num_blocks.any():
                continue
            later = slots[slices[i + 1].token_slice.start :]
            written = np.unique(later[later >= 0] // block_size)
            table_rows = table[rows]
            read = table_rows[np.arange(table_rows.shape[1]) < num_blocks[:, None]]
            if np.isin(read, written).any():
                return True
    return False


def _np(tensor: torch.Tensor) -> np.ndarray:
    return tensor.numpy() if tensor.device.type == "cpu" else tensor.cpu().numpy()
