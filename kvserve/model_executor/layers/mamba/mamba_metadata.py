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

    ``state_block_ids[i]``: the pool block holding request i's state (its one block in
    the group). ``has_initial_state[i]``: the request computed tokens before this step;
    otherwise its block's content is stale and the state starts from zeros.
    """

    query_start_loc: list[int]
    state_block_ids: torch.Tensor  # int64 [R]
    has_initial_state: torch.Tensor  # bool [R]
    # Rows with one token this step (decode), run together by the recurrence.
    decode_rows: torch.Tensor  # int64
    decode_tokens: torch.Tensor  # int64: their token index in the flattened batch
    # The other rows (prefill chunks, drafts), run one by one.
    other_rows: list[int]
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
    def build(self, common: CommonAttentionMetadata) -> MambaMetadata:
        num_reqs = common.num_reqs
        starts = common.query_start_loc_cpu[: num_reqs + 1]
        query_lens = starts[1:] - starts[:-1]
        is_decode = query_lens == 1
        rows = torch.arange(num_reqs)
        block_ids = common.block_table_tensor[:num_reqs, 0].to(torch.int64).cpu()
        return MambaMetadata(
            query_start_loc=starts.tolist(),
            state_block_ids=block_ids,
            has_initial_state=common.num_computed_tokens_cpu[:num_reqs] > 0,
            decode_rows=rows[is_decode],
            decode_tokens=starts[:-1][is_decode].to(torch.int64),
            other_rows=rows[~is_decode].tolist(),
        )
