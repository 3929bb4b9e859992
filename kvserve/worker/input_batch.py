"""The persistent batch: requests keep their row step after step; only diffs are applied."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvserve.sample.sampling_batch import SamplingBatch
from kvserve.worker.block_table import MultiGroupBlockTable
from kvserve.worker.prefix_views import PrefixViews
from kvserve.worker.request_state import CachedRequestState


class InputBatch:
    """Per-row token ids, progress, block tables and sampling state of running requests.

    Rows freed by ``remove_request`` are reused by the next ``add_request``;
    ``condense`` then moves the last rows into any remaining holes so the rows in use
    are always ``0..num_reqs-1`` when a step is prepared.
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        device: torch.device,
        block_sizes: Sequence[int],
        sampling_batch: SamplingBatch,
        pin_memory: bool = False,
        max_block_table_len: int | None = None,
    ) -> None:
        """``max_block_table_len``: the token span a block table row covers, where a
        group holds more than the context (a cross-attention group's encoder output)."""
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len

        self.token_ids_cpu_tensor = torch.zeros(
            (max_num_reqs, max_model_len), dtype=torch.int32, pin_memory=pin_memory
        )
        self.token_ids_cpu = self.token_ids_cpu_tensor.numpy()
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens_cpu_tensor = torch.zeros(
            max_num_reqs, dtype=torch.int32, pin_memory=pin_memory
        )
        self.num_computed_tokens_cpu = self.num_computed_tokens_cpu_tensor.numpy()
        self.num_computed_tokens_views = PrefixViews(self.num_computed_tokens_cpu_tensor)

        self.block_table = MultiGroupBlockTable(
            max_num_reqs,
            max(max_model_len, max_block_table_len or 0),
            max_num_batched_tokens,
            block_sizes,
            device,
            pin_memory,
        )
        self.sampling_batch = sampling_batch

        # Row -> request; None marks a hole left by a removed request.
        self._req_ids: list[str | None] = []
        self.req_id_to_index: dict[str, int] = {}
        self.requests: list[CachedRequestState | None] = []
        self._holes: list[int] = []

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    @property
    def req_ids(self) -> list[str]:
        """Request ids by row; only valid as a dense list after ``condense``."""
        return [r for r in self._req_ids if r is not None]

    def add_request(self, request: CachedRequestState, row: int | None = None) -> int:
        if request.req_id in self.req_id_to_index:
            raise ValueError(f"request {request.req_id!r} is already in the batch")
        if row is None:
            row = min(self._holes) if self._holes else len(self._req_ids)
        if row >= self.max_num_reqs:
            raise ValueError(f"the batch is full (max_num_reqs={self.max_num_reqs})")
        if row < len(self._req_ids):
            if self._req_ids[row] is not None:
                raise ValueError(f"row {row} is taken by {self._req_ids[row]!r}")
            self._holes.remove(row)
        else:
            # Rows between the old end and `row` become holes.
            self._holes.extend(range(len(self._req_ids), row))
            self._req_ids.extend([None] * (row + 1 - len(self._req_ids)))
            self.requests.extend([None] * (row + 1 - len(self.requests)))
        self._req_ids[row] = request.req_id
        self.requests[row] = request
        self.req_id_to_index[request.req_id] = row

        num_prompt = request.num_prompt_tokens
        num_tokens = request.num_tokens
        if num_tokens > self.max_model_len:
            raise ValueError(
                f"request {request.req_id!r} has {num_tokens} tokens, more than "
                f"max_model_len={self.max_model_len}"
            )
        self.token_ids_cpu[row, :num_prompt] = request.prompt_token_ids
        self.token_ids_cpu[row, num_prompt:num_tokens] = request.output_token_ids
        self.num_tokens[row] = num_tokens
        self.num_prompt_tokens[row] = num_prompt
        self.num_computed_tokens_cpu[row] = request.num_computed_tokens
        self.block_table.add_row(request.block_ids, row)
        self.sampling_batch.add_request(
            row,
            request.sampling_params,
            request.prompt_token_ids,
            request.output_token_ids,
            request.generator,
            request.eos_token_id,
        )
        return row

    def request_census(self) -> dict[str, int]:
        sampling = self.sampling_batch.request_census()
        return {
            "rows": len(self.req_id_to_index),
            "row_states": sum(r is not None for r in self.requests),
            **{f"sampling.{k}": v for k, v in sampling.items()},
        }

    def remove_request(self, req_id: str) -> int | None:
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return None
        self._req_ids[row] = None
        self.requests[row] = None
        self._holes.append(row)
        self.block_table.clear_row(row)
        self.sampling_batch.remove_request(row)
        return row

    def _move_row(self, src: int, dst: int) -> None:
        req_id = self._req_ids[src]
        assert req_id is not None and self._req_ids[dst] is None
        n = int(self.num_tokens[src])
        self.token_ids_cpu[dst, :n] = self.token_ids_cpu[src, :n]
        self.num_tokens[dst] = n
        self.num_prompt_tokens[dst] = self.num_prompt_tokens[src]
        self.num_computed_tokens_cpu[dst] = self.num_computed_tokens_cpu[src]
        self.block_table.move_row(src, dst)
        self.sampling_batch.move_request(src, dst)
        self.block_table.clear_row(src)
        self._req_ids[dst], self._req_ids[src] = req_id, None
        self.requests[dst], self.requests[src] = self.requests[src], None
        self.req_id_to_index[req_id] = dst

    def condense(self) -> None:
        """Fill holes with the last rows so the rows in use are 0..num_reqs-1."""
        if self._holes:
            num_reqs = self.num_reqs
            last = len(self._req_ids) - 1
            for hole in sorted(self._holes):
                if hole >= num_reqs:
                    break
                while self._req_ids[last] is None:
                    last -= 1
                self._move_row(last, hole)
                last -= 1
            self._holes.clear()
        del self._req_ids[self.num_reqs :]
        del self.requests[self.num_reqs :]

    def swap_states(self, a: int, b: int) -> None:
        """Exchange two rows in use (e.g. to reorder decodes before prefills)."""
        id_a, id_b = self._req_ids[a], self._req_ids[b]
        assert id_a is not None and id_b is not None
        n = int(max(self.num_tokens[a], self.num_tokens[b]))
        self.token_ids_cpu[[a, b], :n] = self.token_ids_cpu[[b, a], :n]
        for arr in (self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens_cpu):
            arr[[a, b]] = arr[[b, a]]
        self.block_table.swap_row(a, b)
        self.sampling_batch.swap_requests(a, b)
        self._req_ids[a], self._req_ids[b] = id_b, id_a
        self.requests[a], self.requests[b] = self.requests[b], self.requests[a]
        self.req_id_to_index[id_a], self.req_id_to_index[id_b] = b, a

    def append_token_ids(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Write one sampled token per row at its end; tokens past max_model_len are
        dropped here (the scheduler finishes such requests). Only RequestStates calls
        this and extend_token_ids, so the requests' token lists stay in step."""
        if len(rows) == 1:  # a single stream: scalar indexing, ~10x cheaper than fancy
            row, end = rows[0], self.num_tokens[rows[0]]
            if end < self.max_model_len:
                self.token_ids_cpu[row, end] = token_ids[0]
                self.num_tokens[row] = end + 1
            return
        ends = self.num_tokens[rows]
        fits = ends < self.max_model_len
        self.token_ids_cpu[rows[fits], ends[fits]] = token_ids[fits]
        self.num_tokens[rows] = np.minimum(ends + 1, self.max_model_len)

    def extend_token_ids(self, row: int, token_ids: list[int]) -> None:
        """Write several tokens at one row's end, dropped past max_model_len as above."""
        start = int(self.num_tokens[row])
        end = min(start + len(token_ids), self.max_model_len)
        self.token_ids_cpu[row, start:end] = token_ids[: end - start]
        self.num_tokens[row] = end
