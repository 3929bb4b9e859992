"""InputPreparer against the step inputs written out token by token: a decode-only batch
(its fast path) and a mixed batch give each token its row's next positions, token ids,
slots and sampling rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.sample.sampling_batch import SamplingBatch
from kvserve.sampling_params import SamplingParams
from kvserve.worker.input_batch import InputBatch
from kvserve.worker.input_preparation import InputPreparer
from kvserve.worker.request_state import CachedRequestState

CPU = torch.device("cpu")
BLOCK_SIZE = 4


def _batch(token_lists: list[list[int]], computed: list[int]) -> InputBatch:
    batch = InputBatch(4, 16, 32, CPU, [BLOCK_SIZE], SamplingBatch(4, 64, CPU))
    for i, (tokens, done) in enumerate(zip(token_lists, computed, strict=True)):
        # Row i's blocks are 10i+1, 10i+2, ...: slots tell rows and blocks apart.
        blocks = [10 * i + 1 + b for b in range(4)]
        state = CachedRequestState(f"r{i}", tokens[:2], SamplingParams(), None, (blocks,), done)
        state.output_token_ids.extend(tokens[2:])
        batch.add_request(state)
    return batch


@pytest.mark.parametrize(
    ("computed", "scheduled"),
    [([4, 6, 9], [1, 1, 1]), ([7], [1]), ([4, 0, 9], [1, 3, 1]), ([2, 5], [2, 1])],
)
def test_inputs_match_token_by_token(computed: list[int], scheduled: list[int]) -> None:
    token_lists = [
        [100 * i + t for t in range(c + n)]
        for i, (c, n) in enumerate(zip(computed, scheduled, strict=True))
    ]
    batch = _batch(token_lists, computed)
    by_id = {f"r{i}": n for i, n in enumerate(scheduled)}
    inputs = InputPreparer(4, 32, CPU, False).prepare(batch, by_id, sum(scheduled))

    ids, positions, slots = [], [], []
    for i, (done, n) in enumerate(zip(computed, scheduled, strict=True)):
        for pos in range(done, done + n):
            ids.append(token_lists[i][pos])
            positions.append(pos)
            slots.append((10 * i + 1 + pos // BLOCK_SIZE) * BLOCK_SIZE + pos % BLOCK_SIZE)
    common = inputs.common_attn_metadata[0]
    assert inputs.input_ids.tolist() == ids
    assert inputs.positions.tolist() == positions
    assert inputs.positions_np.tolist() == positions
    assert common.slot_mapping.tolist() == slots
    assert inputs.num_scheduled_tokens.tolist() == scheduled
    assert inputs.query_start_loc_np.tolist() == [0, *np.cumsum(scheduled).tolist()]
    assert common.seq_lens_cpu.tolist() == [c + n for c, n in zip(computed, scheduled, strict=True)]
    assert common.max_query_len == max(scheduled)
    # Every row reaches its known tokens here, so every row samples at its last token.
    assert inputs.sample_rows.tolist() == list(range(len(computed)))
    assert inputs.logits_indices.tolist() == (np.cumsum(scheduled) - 1).tolist()
