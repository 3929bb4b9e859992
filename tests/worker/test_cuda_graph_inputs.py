"""The captured graphs' persistent inputs: padding choice, refills and slicing (device
independent, so checked here on the CPU)."""

from __future__ import annotations

import torch

from kvserve.attention.backends.utils import make_common_attn_metadata
from kvserve.worker.cuda_graph_inputs import StaticDecodeInputs, is_uniform_decode, padded_size


def test_padded_size_is_the_next_captured_size() -> None:
    sizes = [1, 2, 4, 8, 16]
    assert [padded_size(sizes, n) for n in (1, 2, 3, 5, 8, 9, 16)] == [1, 2, 4, 8, 8, 16, 16]
    assert padded_size(sizes, 17) is None
    assert padded_size([], 1) is None


def test_only_one_token_per_request_is_a_uniform_decode() -> None:
    decode = make_common_attn_metadata([1, 1, 1], [5, 9, 2], [[1], [2], [3]], 16)
    mixed = make_common_attn_metadata([1, 4], [5, 0], [[1], [2]], 16)
    assert is_uniform_decode(decode) and not is_uniform_decode(mixed)


def test_load_copies_n_rows_and_pads_to_the_captured_size() -> None:
    """3 decodes replayed as 4: the padding row is a length-1 request on block 0 that
    writes no slot; the two groups keep their own tables and slots."""
    static = StaticDecodeInputs(8, [4, 2], max_model_len=64, device=torch.device("cpu"))
    tables = [[7, 3], [5], [9, 2, 6]]
    computed = [20, 3, 40]
    g0 = make_common_attn_metadata([1, 1, 1], computed, tables, 16)
    g1 = make_common_attn_metadata([1, 1, 1], computed, [[1], [2], [3]], 64)
    # Earlier step's leftovers must not survive as padding.
    static.input_ids.fill_(99)
    static.groups[0].block_table.fill_(77)
    static.load(torch.tensor([11, 12, 13]), torch.tensor([20, 3, 40]), [g0, g1], size=4)
    assert static.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert static.positions[:4].tolist() == [20, 3, 40, 0]
    assert static.seq_lens[:4].tolist() == [21, 4, 41, 1]
    assert static.groups[0].block_table[:4, :3].tolist() == [
        [7, 3, 0],
        [5, 0, 0],
        [9, 2, 6],
        [0, 0, 0],
    ]
    assert static.groups[0].slot_mapping[:4].tolist() == [*g0.slot_mapping.tolist(), -1]
    assert static.groups[1].slot_mapping[:4].tolist() == [*g1.slot_mapping.tolist(), -1]
    assert static.groups[1].block_table[:4, 0].tolist() == [1, 2, 3, 0]


def test_common_metadata_views_the_buffers_at_the_captured_size() -> None:
    static = StaticDecodeInputs(8, [4], max_model_len=64, device=torch.device("cpu"))
    (common,) = static.common_metadata(4)
    assert (common.num_reqs, common.num_actual_tokens, common.max_query_len) == (4, 4, 1)
    # The host-side bound the capture bakes in holds for every later step.
    assert common.max_seq_len == 64
    assert common.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert common.seq_lens.data_ptr() == static.seq_lens.data_ptr()
    assert common.block_table_tensor.data_ptr() == static.groups[0].block_table.data_ptr()
    assert common.slot_mapping.data_ptr() == static.groups[0].slot_mapping.data_ptr()
    assert common.block_table_tensor.shape == (4, 4)
