"""The CPU decode kernel's inputs, written into reused buffers (cpu_decode_inputs.py),
against the torch expressions they replace."""

from __future__ import annotations

import torch

from kvserve.attention.backends.cpu_decode_inputs import CPUDecodeInputs


def _expected(table: torch.Tensor, num_reqs: int, reqs: list[int], num_blocks: int) -> torch.Tensor:
    rows = table[:num_reqs, :num_blocks][torch.tensor(reqs)]
    return rows.clamp(min=0).to(torch.int32)


def test_rows_are_selected_clamped_and_contiguous() -> None:
    gen = torch.Generator().manual_seed(0)
    table = torch.randint(-1, 50, (6, 10), dtype=torch.int32, generator=gen)
    inputs = CPUDecodeInputs()
    for reqs, num_blocks in (([0, 1, 2, 3], 4), ([1, 4], 7), ([0, 1, 2, 3, 4, 5], 10)):
        starts = [3 * r for r in reqs]
        lens = [10 + r for r in reqs]
        token_indices, block_table, seq_lens = inputs.build(
            table, 6, reqs, starts, lens, num_blocks
        )
        assert block_table.is_contiguous() and block_table.dtype == torch.int32
        assert torch.equal(block_table, _expected(table, 6, reqs, num_blocks))
        assert token_indices.dtype == torch.int64 and token_indices.tolist() == starts
        assert seq_lens.dtype == torch.int32 and seq_lens.tolist() == lens


def test_same_shape_reuses_the_tensors_with_the_new_values() -> None:
    table = torch.tensor([[3, 4, -1], [5, -1, -1]], dtype=torch.int32)
    inputs = CPUDecodeInputs()
    first = inputs.build(table, 2, [0, 1], [0, 1], [9, 5], 3)
    table[1, 1] = 8
    second = inputs.build(table, 2, [0, 1], [0, 1], [10, 6], 3)
    assert all(a is b for a, b in zip(first, second, strict=True))
    assert second[1].tolist() == [[3, 4, 0], [5, 8, 0]]
    assert second[2].tolist() == [10, 6]


def test_growing_past_the_buffers_keeps_earlier_shapes_right() -> None:
    inputs = CPUDecodeInputs()
    small = torch.tensor([[1, 2]], dtype=torch.int32)
    assert inputs.build(small, 1, [0], [0], [2], 2)[1].tolist() == [[1, 2]]
    big = torch.arange(64 * 40, dtype=torch.int32).reshape(64, 40)
    got = inputs.build(big, 64, list(range(64)), list(range(64)), [40] * 64, 40)[1]
    assert torch.equal(got, big)
    assert inputs.build(small, 1, [0], [0], [2], 2)[1].tolist() == [[1, 2]]
