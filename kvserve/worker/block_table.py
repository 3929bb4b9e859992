"""Per-row block tables of the persistent batch and the slot mapping built from them."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvserve.worker.prefix_views import PrefixViews


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockTable:
    """One KV cache group's block ids, one row per batch row.

    The CPU table is the source of truth (numpy view for cheap small writes); ``commit``
    copies the rows in use to the device table the attention backend reads (on the CPU
    that table is the CPU table itself).
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_num_blocks_per_req: int,
        max_num_batched_tokens: int,
        block_size: int,
        device: torch.device,
        pin_memory: bool = False,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_num_blocks_per_req = max_num_blocks_per_req
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = block_size
        self.device = device

        shape = (max_num_reqs, max_num_blocks_per_req)
        self.block_table_cpu = torch.zeros(shape, dtype=torch.int32, pin_memory=pin_memory)
        self.block_table_np = self.block_table_cpu.numpy()
        # On the CPU the backend reads the CPU table itself (no copy per step).
        on_cpu = torch.device(device).type == "cpu"
        self.block_table = (
            self.block_table_cpu if on_cpu else torch.zeros(shape, dtype=torch.int32, device=device)
        )
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)

        self.slot_mapping_cpu = torch.zeros(
            max_num_batched_tokens, dtype=torch.int64, pin_memory=pin_memory
        )
        self.slot_mapping_np = self.slot_mapping_cpu.numpy()
        self.slot_mapping = (
            self.slot_mapping_cpu
            if on_cpu
            else torch.zeros(max_num_batched_tokens, dtype=torch.int64, device=device)
        )

        self._block_table_views = PrefixViews(self.block_table)
        self._slot_mapping_views = PrefixViews(self.slot_mapping)

    def append_row(self, block_ids: Sequence[int], row: int) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks_per_row[row])
        end = start + len(block_ids)
        if end > self.max_num_blocks_per_req:
            raise ValueError(
                f"row {row} would hold {end} blocks, more than max_num_blocks_per_req="
                f"{self.max_num_blocks_per_req}"
            )
        self.block_table_np[row, start:end] = block_ids
        self.num_blocks_per_row[row] = end

    def add_row(self, block_ids: Sequence[int], row: int) -> None:
        self.num_blocks_per_row[row] = 0
        self.append_row(block_ids, row)

    def move_row(self, src: int, tgt: int) -> None:
        n = int(self.num_blocks_per_row[src])
        self.block_table_np[tgt, :n] = self.block_table_np[src, :n]
        self.num_blocks_per_row[tgt] = n

    def swap_row(self, a: int, b: int) -> None:
        self.num_blocks_per_row[[a, b]] = self.num_blocks_per_row[[b, a]]
        self.block_table_np[[a, b]] = self.block_table_np[[b, a]]

    def clear_row(self, row: int) -> None:
        self.num_blocks_per_row[row] = 0

    def compute_slot_mapping(self, req_indices: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Slot (``block_id * block_size + offset``) of each scheduled token.

        ``req_indices[i]`` is the row of token ``i`` and ``positions[i]`` its position in
        that request. Writes into and returns a view of the preallocated CPU buffer.
        """
        n = len(positions)
        flat_index = req_indices * self.max_num_blocks_per_req + positions // self.block_size
        block_ids = self.block_table_np.reshape(-1)[flat_index]
        out = self.slot_mapping_np[:n]
        np.add(block_ids.astype(np.int64) * self.block_size, positions % self.block_size, out=out)
        return out

    def commit(self, num_reqs: int) -> None:
        """Copy the first ``num_reqs`` rows to the device table."""
        if self.block_table is not self.block_table_cpu:
            self.block_table[:num_reqs].copy_(self.block_table_cpu[:num_reqs], non_blocking=True)

    def commit_slot_mapping(self, num_tokens: int) -> torch.Tensor:
        if self.slot_mapping is not self.slot_mapping_cpu:
            self.slot_mapping[:num_tokens].copy_(
                self.slot_mapping_cpu[:num_tokens], non_blocking=True
            )
        return self._slot_mapping_views[num_tokens]

    def get_device_tensor(self, num_reqs: int) -> torch.Tensor:
        return self._block_table_views[num_reqs]

    def get_row(self, row: int) -> list[int]:
        return self.block_table_np[row, : self.num_blocks_per_row[row]].tolist()


class MultiGroupBlockTable:
    """One ``BlockTable`` per KV cache group; row operations apply to all of them."""

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        block_sizes: Sequence[int],
        device: torch.device,
        pin_memory: bool = False,
    ) -> None:
        self.block_tables = [
            BlockTable(
                max_num_reqs,
                cdiv(max_model_len, bs),
                max_num_batched_tokens,
                bs,
                device,
                pin_memory,
            )
            for bs in block_sizes
        ]

    def append_row(self, block_ids: tuple[list[int], ...], row: int) -> None:
        for table, ids in zip(self.block_tables, block_ids, strict=True):
            table.append_row(ids, row)

    def add_row(self, block_ids: tuple[list[int], ...], row: int) -> None:
        for table, ids in zip(self.block_tables, block_ids, strict=True):
            table.add_row(ids, row)

    def move_row(self, src: int, tgt: int) -> None:
        for table in self.block_tables:
            table.move_row(src, tgt)

    def swap_row(self, a: int, b: int) -> None:
        for table in self.block_tables:
            table.swap_row(a, b)

    def clear_row(self, row: int) -> None:
        for table in self.block_tables:
            table.clear_row(row)

    def compute_slot_mapping(self, req_indices: np.ndarray, positions: np.ndarray) -> None:
        for table in self.block_tables:
            table.compute_slot_mapping(req_indices, positions)

    def commit(self, num_reqs: int) -> None:
        for table in self.block_tables:
            table.commit(num_reqs)

    def __getitem__(self, group: int) -> BlockTable:
        return self.block_tables[group]

    def __len__(self) -> int:
        return len(self.block_tables)
