"""The persistent inputs of captured decode graphs: one set of device buffers sized for
the largest captured batch, which every replay refills in place (a graph replays the
addresses it recorded, so a step's tensors must be copied to where the capture saw them).

A decode batch of ``n`` tokens runs as the next captured size ``N >= n``. Rows ``n..N``
are padding: each is a one-token request of length 1 whose block table row is block 0
and whose slot is -1, so it reads a harmless key, writes nothing and its output row is
dropped. Device-independent: the CPU tests check the padding and the slicing.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from kvserve.attention.backends.utils import CommonAttentionMetadata


def padded_size(capture_sizes: list[int], num_tokens: int) -> int | None:
    """The smallest captured size holding ``num_tokens`` (sorted ``capture_sizes``), or
    None when the batch is larger than every graph (it runs eagerly)."""
    i = bisect.bisect_left(capture_sizes, num_tokens)
    return capture_sizes[i] if i < len(capture_sizes) else None


def is_uniform_decode(common: CommonAttentionMetadata) -> bool:
    """Every request adds exactly one token: the only steps the graphs were captured for."""
    return common.num_reqs > 0 and common.num_actual_tokens == common.num_reqs


@dataclass
class _GroupBuffers:
    """One KV cache group's own inputs (groups differ in block table and slot mapping)."""

    block_table: torch.Tensor  # int32 [max_size, width]
    slot_mapping: torch.Tensor  # int64 [max_size]


class StaticDecodeInputs:
    def __init__(
        self,
        max_size: int,
        block_table_widths: list[int],
        max_model_len: int,
        device: torch.device,
    ) -> None:
        self.max_size = max_size
        self.max_model_len = max_model_len
        self.input_ids = torch.zeros(max_size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_size, dtype=torch.int64, device=device)
        # One token per request in every captured batch, padding included: never rewritten.
        self.query_start_loc = torch.arange(max_size + 1, dtype=torch.int32, device=device)
        self.query_start_loc_cpu = torch.arange(max_size + 1, dtype=torch.int32)
        self.seq_lens = torch.ones(max_size, dtype=torch.int32, device=device)
        self.groups = [
            _GroupBuffers(
                torch.zeros(max_size, width, dtype=torch.int32, device=device),
                torch.full((max_size,), -1, dtype=torch.int64, device=device),
            )
            for width in block_table_widths
        ]

    def common_metadata(self, size: int) -> list[CommonAttentionMetadata]:
        """Per group, metadata of a ``size``-token decode batch over these buffers. Its
        max_seq_len is max_model_len: what a backend derives from it on the host (the
        split-KV count) is then fixed by the capture and right for any later step."""
        seq_lens_cpu = torch.ones(size, dtype=torch.int32)
        return [
            CommonAttentionMetadata(
                query_start_loc=self.query_start_loc[: size + 1],
                query_start_loc_cpu=self.query_start_loc_cpu[: size + 1],
                seq_lens=self.seq_lens[:size],
                seq_lens_cpu=seq_lens_cpu,
                num_computed_tokens_cpu=torch.zeros(size, dtype=torch.int32),
                num_reqs=size,
                num_actual_tokens=size,
                max_query_len=1,
                max_seq_len=self.max_model_len,
                block_table_tensor=group.block_table[:size],
                slot_mapping=group.slot_mapping[:size],
            )
            for group in self.groups
        ]

    def load(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        commons: list[CommonAttentionMetadata],
        size: int,
    ) -> None:
        """Copy a decode step of ``n = len(input_ids)`` tokens into the buffers and pad
        rows ``n..size`` (device-to-device copies only: no sync)."""
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.seq_lens[:n].copy_(commons[0].seq_lens[:n])
        if n < size:
            self.input_ids[n:size] = 0
            self.positions[n:size] = 0
            self.seq_lens[n:size] = 1
        for group, common in zip(self.groups, commons, strict=True):
            table = common.block_table_tensor[:n]
            width = min(table.shape[1], group.block_table.shape[1])
            group.block_table[:n, :width].copy_(table[:, :width])
            group.slot_mapping[:n].copy_(common.slot_mapping[:n])
            if n < size:
                group.block_table[n:size] = 0
                group.slot_mapping[n:size] = -1
