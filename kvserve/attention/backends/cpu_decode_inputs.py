"""The C++ decode kernel's per-step inputs on the CPU, written into reused buffers."""

from __future__ import annotations

import numpy as np
import torch

from kvserve.utils.numpy_views import numpy_view

# (rows, blocks) shapes whose tensors are kept before the cache starts over: a server's
# batch sizes and context lengths would otherwise add entries for as long as it runs.
MAX_SHAPES = 1024


class CPUDecodeInputs:
    """(token_indices int64 [D], block_table int32 [D, num_blocks] contiguous and clamped
    at 0, seq_lens int32 [D]) for a step's decode rows, computed in numpy into buffers
    that outlive the step and handed out as tensors made once per shape.

    A single-stream step runs its Python with the caches the forward's weight stream has
    just flushed, where each torch call (a slice, a clamp, a ``torch.tensor``) costs
    5-15 us; numpy writes into kept arrays cost ~1 us. A step's tensors are valid until
    the next step's ``build`` (the backend reads them during that step's forward only).
    """

    def __init__(self) -> None:
        self._capacity = 0
        self._table = np.zeros(0, dtype=np.int32)
        self._rows = np.zeros(0, dtype=np.int64)
        self._lens = np.zeros(0, dtype=np.int32)
        self._tensors: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}

    def _reserve(self, num_rows: int, num_blocks: int) -> None:
        if num_rows * num_blocks <= self._capacity and num_rows <= len(self._rows):
            return
        # Growing replaces the arrays: tensors made for the old ones are dropped.
        self._capacity = max(num_rows * num_blocks, 2 * self._capacity)
        self._table = np.zeros(self._capacity, dtype=np.int32)
        self._rows = np.zeros(max(num_rows, 2 * len(self._rows)), dtype=np.int64)
        self._lens = np.zeros(len(self._rows), dtype=np.int32)
        self._tensors.clear()

    def build(
        self,
        block_table: torch.Tensor,
        num_reqs: int,
        reqs: list[int],
        token_starts: list[int],
        lens: list[int],
        num_blocks: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``block_table``: the step's [num_reqs, max_blocks] table (-1 padding allowed);
        ``reqs`` the decode rows in order, with their token index and sequence length."""
        d = len(reqs)
        self._reserve(d, num_blocks)
        tensors = self._tensors.get((d, num_blocks))
        if tensors is None:
            if len(self._tensors) >= MAX_SHAPES:
                self._tensors.clear()
            tensors = self._tensors[(d, num_blocks)] = (
                torch.from_numpy(self._rows[:d]),
                torch.from_numpy(self._table[: d * num_blocks].reshape(d, num_blocks)),
                torch.from_numpy(self._lens[:d]),
            )
        table = numpy_view(block_table)[:num_reqs, :num_blocks]
        if d < num_reqs:
            table = table[reqs]
        np.maximum(table, 0, out=self._table[: d * num_blocks].reshape(d, num_blocks))
        self._rows[:d] = token_starts
        self._lens[:d] = lens
        return tensors  # type: ignore[return-value]
