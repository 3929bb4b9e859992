from __future__ import annotations

import numpy as np
import torch

from kvserve.worker.block_table import BlockTable, MultiGroupBlockTable


def _naive_slots(rows: list[list[int]], reqs: list[int], pos: list[int], bs: int) -> list[int]:
    return [rows[r][p // bs] * bs + p % bs for r, p in zip(reqs, pos, strict=True)]


def test_slot_mapping_matches_naive() -> None:
    rng = np.random.default_rng(0)
    bs = 4
    table = BlockTable(8, 16, 256, bs, torch.device("cpu"))
    rows = [rng.permutation(100)[: rng.integers(1, 16)].tolist() for _ in range(8)]
    for row, ids in enumerate(rows):
        table.add_row(ids[:2], row)
        table.append_row(ids[2:], row)
    reqs, pos = [], []
    for row, ids in enumerate(rows):
        start = int(rng.integers(0, len(ids) * bs))
        n = int(rng.integers(0, len(ids) * bs - start + 1))
        reqs += [row] * n
        pos += list(range(start, start + n))
    got = table.compute_slot_mapping(np.array(reqs, dtype=np.int64), np.array(pos, dtype=np.int64))
    assert got.tolist() == _naive_slots(rows, reqs, pos, bs)
    device_slots = table.commit_slot_mapping(len(pos))
    assert device_slots.dtype == torch.int64
    assert device_slots.tolist() == got.tolist()
    table.commit(8)
    for row, ids in enumerate(rows):
        assert table.get_device_tensor(8)[row, : len(ids)].tolist() == ids


def test_move_swap_clear_rows() -> None:
    table = BlockTable(4, 8, 16, 2, torch.device("cpu"))
    table.add_row([5, 6, 7], 0)
    table.add_row([9], 1)
    table.swap_row(0, 1)
    assert table.get_row(0) == [9] and table.get_row(1) == [5, 6, 7]
    table.move_row(1, 3)
    assert table.get_row(3) == [5, 6, 7]
    table.clear_row(3)
    assert table.get_row(3) == []
    table.add_row([1, 2], 3)  # add replaces, append extends
    table.append_row([4], 3)
    assert table.get_row(3) == [1, 2, 4]


def test_multi_group_uses_each_groups_block_size() -> None:
    tables = MultiGroupBlockTable(2, 32, 64, [4, 8], torch.device("cpu"))
    tables.add_row(([1, 2, 3], [7, 8]), 0)
    pos = np.arange(10, dtype=np.int64)
    tables.compute_slot_mapping(np.zeros(10, dtype=np.int64), pos)
    assert tables[0].slot_mapping_np[:10].tolist() == _naive_slots(
        [[1, 2, 3]], [0] * 10, list(pos), 4
    )
    assert tables[1].slot_mapping_np[:10].tolist() == _naive_slots([[7, 8]], [0] * 10, list(pos), 8)


def test_on_the_cpu_the_device_table_is_the_cpu_table() -> None:
    # No copy per step: the backend reads the rows as soon as they are written.
    table = BlockTable(4, 8, 16, 2, torch.device("cpu"))
    table.add_row([5, 6], 0)
    assert table.get_device_tensor(1)[0, :2].tolist() == [5, 6]
    assert table.get_device_tensor(1).data_ptr() == table.block_table_cpu.data_ptr()
    table.compute_slot_mapping(np.array([0, 0]), np.array([1, 2]))
    assert table.commit_slot_mapping(2).tolist() == [11, 12]
    assert table.commit_slot_mapping(2) is table.commit_slot_mapping(2)
