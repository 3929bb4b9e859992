"""What a step's Mamba layers need to know about the batch, built once per step per
Mamba group (every layer of the group reuses it), vLLM's Mamba2AttentionMetadata."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvserve.attention.backends.abstract import AttentionMetadataBuilder
from kvserve.attention.backends.utils import CommonAttentionMetadata


@dataclass
class MambaMetadata:
    """Requests in batch order; request ``i`` owns tokens ``query_start_loc[i]:[i+1]``.

    ``state_block_ids[i]``: the pool block request i's state is read from;
    ``write_block_ids[i]``: where its state after the step goes (the same block, but
    with prefix caching a step may end in a later block's entry, core/mamba_manager.py).
    ``has_initial_state[i]``: the request computed tokens before this step; otherwise
    its block's content is stale and the state starts from zeros.
    """

    query_start_loc: list[int]
    state_block_ids: torch.Tensor  # int64 [R]
    write_block_ids: torch.Tensor  # int64 [R]
    has_initial_state: torch.Tensor  # bool [R]
    # Rows with one token this step (decode), run together by the recurrence.
    decode_rows: torch.Tensor  # int64
    decode_tokens: torch.Tensor  # int64: their token index in the flattened batch
    # The other rows (prefill chunks, drafts), run one by one.
    other_rows: list[int]
    # Prefix caching: per other row, (tokens into the row, block) for each block end
    # the row crosses before its last token: the state there is that block's entry.
    boundaries: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    # Per other row, the block of the state after each of its tokens (spec decode puts
    # the state after the accepted tokens there).
    position_block_ids: dict[int, list[int]] = field(default_factory=dict)
    # Speculative decoding: rows whose state after every position is kept, so the state
    # after the accepted tokens can be put back (worker/mamba_state_runner.py) ...
    keep_position_states: set[int] = field(default_factory=set)
    # ... and those states per layer: row -> (conv [n, K-1, D], ssm [n, H, P, N]).
    position_states: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = field(
        default_factory=dict
    )

    @property
    def num_reqs(self) -> int:
        return len(self.query_start_loc) - 1


class MambaMetadataBuilder(AttentionMetadataBuilder):
    """``align``: prefix caching's table layout (a state entry per token block), else
    one state block per request at column 0."""

    def __init__(self, block_size: int, device: torch.device | str, align: bool = False) -> None:
        super().__init__(block_size, device)
        self.align = align

    def build(self, common: CommonAttentionMetadata) -> MambaMetadata:
        num_reqs = common.num_reqs
        starts = common.query_start_loc_cpu[: num_reqs + 1]
        query_lens = starts[1:] - starts[:-1]
        is_decode = query_lens == 1
        rows = torch.arange(num_reqs)
        table = common.block_table_tensor[:num_reqs].to(torch.int64).cpu()
        computed = common.num_computed_tokens_cpu[:num_reqs].to(torch.int64)
        if self.align:
            read_col = (computed - 1).clamp(min=0) // self.block_size
            write_col = (computed + query_lens - 1) // self.block_size
        else:
            read_col = write_col = torch.zeros(num_reqs, dtype=torch.int64)
        metadata = MambaMetadata(
            query_start_loc=starts.tolist(),
            state_block_ids=table[rows, read_col],
            write_block_ids=table[rows, write_col],
            has_initial_state=computed > 0,
            decode_rows=rows[is_decode],
            decode_tokens=starts[:-1][is_decode].to(torch.int64),
            other_rows=rows[~is_decode].tolist(),
        )
        for row in metadata.other_rows:
            n, first = int(query_lens[row]), int(computed[row])
            if not self.align:
                metadata.position_block_ids[row] = [int(table[row, 0])] * n
                continue
            # The state after token j of the row is the entry of token first + j's block.
            cols = (torch.arange(n) + first) // self.block_size
            metadata.position_block_ids[row] = table[row, cols].tolist()
            # The block ends the row crosses before its last token whose entries are
            # blocks (core/mamba_manager.py, align mode): the first (the entry the row
            # read, which becomes full) and the last (the entry before the live one).
            bs = self.block_size
            ends = range(-(-(first + 1) // bs) * bs, first + n, bs)
            if len(ends):
                # (A row starting at a block end read a complete entry: only the last.)
                kept = sorted({ends[0], ends[-1]} if first % bs else {ends[-1]})
                metadata.boundaries[row] = [(e - first, int(table[row, e // bs - 1])) for e in kept]
        return metadata
