"""Turns the persistent batch plus one SchedulerOutput into the step's model inputs.

All index math is vectorised over tokens in numpy, written into preallocated CPU
buffers and copied to the device once (on the CPU the model reads those buffers
directly); Python only iterates over requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.attention.backends.utils import CommonAttentionMetadata
from kvserve.worker.input_batch import InputBatch
from kvserve.worker.prefix_views import PrefixViews


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # int64 [T], device
    positions: torch.Tensor  # int64 [T], device
    positions_np: np.ndarray  # int64 [T], CPU view valid until the next step
    # One per KV cache group (they differ only in block table and slot mapping).
    common_attn_metadata: list[CommonAttentionMetadata]
    num_scheduled_tokens: np.ndarray  # int32 [B], by row
    query_start_loc_np: np.ndarray  # int32 [B+1]
    # Rows whose request reaches the end of its known tokens, i.e. that sample.
    sample_rows: np.ndarray  # int64 [S]
    logits_indices: torch.Tensor  # int64 [S], device: last token of each sampling row


def _pinned(n: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.zeros(n, dtype=dtype, pin_memory=pin)


def _device_views(cpu: torch.Tensor, device: torch.device) -> PrefixViews:
    """The device twin of a CPU buffer (the buffer itself when the device is the CPU)."""
    return PrefixViews(cpu if device.type == "cpu" else torch.zeros_like(cpu, device=device))


class InputPreparer:
    """Owns the reusable CPU and device buffers of the step inputs."""

    def __init__(
        self, max_num_reqs: int, max_num_tokens: int, device: torch.device, pin_memory: bool
    ) -> None:
        self.device = device
        self.arange_np = np.arange(max(max_num_reqs, max_num_tokens) + 1, dtype=np.int64)

        self.input_ids_cpu = _pinned(max_num_tokens, torch.int64, pin_memory)
        self.input_ids_np = self.input_ids_cpu.numpy()
        self.positions_cpu = _pinned(max_num_tokens, torch.int64, pin_memory)
        self.positions_np = self.positions_cpu.numpy()
        self.query_start_loc_cpu = _pinned(max_num_reqs + 1, torch.int32, pin_memory)
        self.query_start_loc_np = self.query_start_loc_cpu.numpy()
        self.seq_lens_cpu = _pinned(max_num_reqs, torch.int32, pin_memory)
        self.seq_lens_np = self.seq_lens_cpu.numpy()
        self.logits_indices_cpu = _pinned(max_num_reqs, torch.int64, pin_memory)
        self.logits_indices_np = self.logits_indices_cpu.numpy()

        # On the CPU the model reads the CPU buffers themselves: a single-stream step spent
        # ~50 us in the five copies, each a few microseconds with the cache cold after the
        # forward's weight stream.
        self.input_ids = _device_views(self.input_ids_cpu, device)
        self.positions = _device_views(self.positions_cpu, device)
        self.query_start_loc = _device_views(self.query_start_loc_cpu, device)
        self.seq_lens = _device_views(self.seq_lens_cpu, device)
        self.logits_indices = _device_views(self.logits_indices_cpu, device)
        self.query_start_loc_cpu_views = PrefixViews(self.query_start_loc_cpu)
        self.seq_lens_cpu_views = PrefixViews(self.seq_lens_cpu)

    def prepare(
        self,
        batch: InputBatch,
        num_scheduled_by_id: dict[str, int],
        total_tokens: int,
        num_common_prefix_blocks: Sequence[int] = (),
    ) -> StepInputs:
        """``num_common_prefix_blocks``: the scheduler's count per KV cache group
        (SchedulerOutput); a group it leaves out gets 0, i.e. no cascade attention."""
        num_reqs = batch.num_reqs
        assert num_reqs > 0 and total_tokens > 0
        req_ids = batch.req_ids
        num_scheduled = np.fromiter(
            (num_scheduled_by_id[r] for r in req_ids), dtype=np.int32, count=num_reqs
        )
        assert int(num_scheduled.sum()) == total_tokens, "scheduled tokens do not add up"

        computed = batch.num_computed_tokens_cpu[:num_reqs]
        positions = self.positions_np[:total_tokens]
        max_query_len = int(num_scheduled.max())
        if max_query_len == 1 and total_tokens == num_reqs:
            # Every row decodes one token (the counts add up, so none is 0): token t is
            # row t at its next position. The general form's cumsum and two repeats cost
            # ~20 us of a single-stream step.
            cu = self.arange_np[1 : num_reqs + 1]
            req_indices = self.arange_np[:num_reqs]
            positions[:] = computed
        else:
            # Token t belongs to row req_indices[t] at offset t - start(row) in the chunk.
            cu = np.cumsum(num_scheduled)
            req_indices = np.repeat(self.arange_np[:num_reqs], num_scheduled)
            offsets = self.arange_np[:total_tokens] - np.repeat(cu - num_scheduled, num_scheduled)
            np.add(computed[req_indices], offsets, out=positions)

        flat = positions + req_indices * batch.max_model_len
        self.input_ids_np[:total_tokens] = batch.token_ids_cpu.reshape(-1)[flat]
        self.query_start_loc_np[0] = 0
        self.query_start_loc_np[1 : num_reqs + 1] = cu
        seq_lens = self.seq_lens_np[:num_reqs]
        np.add(computed, num_scheduled, out=seq_lens)

        # Partial prefill chunks stop short of the known tokens and do not sample.
        sample_rows = np.flatnonzero(seq_lens >= batch.num_tokens[:num_reqs])
        num_sample = len(sample_rows)
        np.subtract(cu[sample_rows], 1, out=self.logits_indices_np[:num_sample])

        batch.block_table.compute_slot_mapping(req_indices, positions)
        batch.block_table.commit(num_reqs)

        def to_device(cpu: torch.Tensor, dev: PrefixViews, n: int) -> torch.Tensor:
            if dev.tensor is not cpu:
                dev.tensor[:n].copy_(cpu[:n], non_blocking=True)
            return dev[n]

        input_ids = to_device(self.input_ids_cpu, self.input_ids, total_tokens)
        positions_dev = to_device(self.positions_cpu, self.positions, total_tokens)
        qsl = to_device(self.query_start_loc_cpu, self.query_start_loc, num_reqs + 1)
        seq_lens_dev = to_device(self.seq_lens_cpu, self.seq_lens, num_reqs)
        logits_indices = to_device(self.logits_indices_cpu, self.logits_indices, num_sample)

        max_seq_len = int(seq_lens.max())
        prefix_blocks = list(num_common_prefix_blocks)
        prefix_blocks += [0] * (len(batch.block_table.block_tables) - len(prefix_blocks))
        commons = [
            CommonAttentionMetadata(
                query_start_loc=qsl,
                query_start_loc_cpu=self.query_start_loc_cpu_views[num_reqs + 1],
                seq_lens=seq_lens_dev,
                seq_lens_cpu=self.seq_lens_cpu_views[num_reqs],
                num_computed_tokens_cpu=batch.num_computed_tokens_views[num_reqs],
                num_reqs=num_reqs,
                num_actual_tokens=total_tokens,
                max_query_len=max_query_len,
                max_seq_len=max_seq_len,
                block_table_tensor=table.get_device_tensor(num_reqs),
                slot_mapping=table.commit_slot_mapping(total_tokens),
                num_common_prefix_blocks=num_prefix_blocks,
            )
            for table, num_prefix_blocks in zip(
                batch.block_table.block_tables, prefix_blocks, strict=False
            )
        ]
        return StepInputs(
            input_ids=input_ids,
            positions=positions_dev,
            positions_np=positions,
            common_attn_metadata=commons,
            num_scheduled_tokens=num_scheduled,
            query_start_loc_np=self.query_start_loc_np[: num_reqs + 1],
            sample_rows=sample_rows,
            logits_indices=logits_indices,
        )
