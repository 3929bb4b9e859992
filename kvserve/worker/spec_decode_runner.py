"""The model runner's side of speculative decoding.

Each step the scheduled drafts are written into the persistent batch's token rows right
after the request's known tokens (they are not counted in ``num_tokens``), so the normal
input preparation feeds them to the model. A sampling row with n drafts then needs the
logits of its last n + 1 tokens, which the RejectionSampler verifies. After sampling, the
proposer drafts the next step's tokens from the batch as it now stands.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvserve.sample.rejection_sampler import RejectionSampler
from kvserve.sample.spec_decode_metadata import SpecDecodeMetadata
from kvserve.spec_decode import Proposer, ProposerInputs, create_proposer

if TYPE_CHECKING:
    from kvserve.config import EngineConfig
    from kvserve.protocol.scheduler_output import SchedulerOutput
    from kvserve.worker.input_batch import InputBatch
    from kvserve.worker.input_preparation import StepInputs


class SpecDecodeModelRunnerMixin:
    config: EngineConfig
    device: torch.device
    input_batch: InputBatch | None

    def init_spec_decode(self) -> None:
        self.drafter: Proposer | None = create_proposer(self.config, self.device)
        self.rejection_sampler = RejectionSampler()

    def write_spec_tokens(self, scheduler_output: SchedulerOutput) -> None:
        """Puts each scheduled request's drafts after its known tokens in the batch."""
        batch = self.input_batch
        assert batch is not None
        for req_id, draft in scheduler_output.scheduled_spec_decode_tokens.items():
            row = batch.req_id_to_index[req_id]
            start = int(batch.num_tokens[row])
            batch.token_ids_cpu[row, start : start + len(draft)] = draft

    def spec_decode_metadata(
        self, scheduler_output: SchedulerOutput, inputs: StepInputs
    ) -> SpecDecodeMetadata | None:
        """Where the drafts' logits are, or None for a step without drafts."""
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        if not spec_tokens:
            return None
        batch = self.input_batch
        assert batch is not None
        req_ids = batch.req_ids
        drafts = [spec_tokens.get(req_ids[row], []) for row in inputs.sample_rows.tolist()]
        last = inputs.query_start_loc_np[inputs.sample_rows + 1] - 1
        return SpecDecodeMetadata.make(drafts, last, self.device)

    def split_spec_rows(self, scheduler_output: SchedulerOutput, inputs: StepInputs) -> None:
        """Attention sees each token of a row with drafts as its own one-token query.

        Token j of such a row attends to the row's first computed + j + 1 positions, which
        is exactly the causal mask of the multi-token query; as one-token queries the step
        stays a decode step (the fused decode kernels run it, as in plain decoding, and
        give the same numbers for every position). Rows without drafts keep their query.
        """
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        if not spec_tokens:
            return
        batch = self.input_batch
        assert batch is not None
        num_reqs = batch.num_reqs
        is_spec = np.fromiter((r in spec_tokens for r in batch.req_ids), dtype=bool, count=num_reqs)
        q_lens = inputs.num_scheduled_tokens.astype(np.int64)
        # Pseudo-rows: a spec row's q_len rows of one token, else the row itself.
        counts = np.where(is_spec, q_lens, 1)
        owner = np.repeat(np.arange(num_reqs), counts)
        first = np.repeat(np.cumsum(counts) - counts, counts)
        index_in_row = np.arange(len(owner)) - first
        new_q_lens = np.where(is_spec[owner], 1, q_lens[owner])
        computed = batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
        new_computed = computed[owner] + np.where(is_spec[owner], index_in_row, 0)
        seq_lens = new_computed + new_q_lens
        cu = np.zeros(len(owner) + 1, dtype=np.int32)
        np.cumsum(new_q_lens, out=cu[1:])
        cu_cpu = torch.from_numpy(cu)
        seq_cpu = torch.from_numpy(seq_lens.astype(np.int32))
        owner_dev = torch.from_numpy(owner).to(self.device)
        inputs.common_attn_metadata = [
            dataclasses.replace(
                common,
                query_start_loc=cu_cpu.to(self.device),
                query_start_loc_cpu=cu_cpu,
                seq_lens=seq_cpu.to(self.device),
                seq_lens_cpu=seq_cpu,
                num_computed_tokens_cpu=torch.from_numpy(new_computed.astype(np.int32)),
                num_reqs=len(owner),
                max_query_len=int(new_q_lens.max()),
                block_table_tensor=common.block_table_tensor[owner_dev],
            )
            for common in inputs.common_attn_metadata
        ]

    def append_sampled_tokens(self, sample_rows: np.ndarray, sampled: list[list[int]]) -> None:
        """Writes each sampling row's tokens (one or several) after its known tokens and
        into its live output list."""
        batch = self.input_batch
        assert batch is not None
        for row, tokens in zip(sample_rows.tolist(), sampled, strict=True):
            start = int(batch.num_tokens[row])
            end = min(start + len(tokens), batch.max_model_len)
            batch.token_ids_cpu[row, start:end] = tokens[: end - start]
            batch.num_tokens[row] = end
            request = batch.requests[row]
            assert request is not None
            request.output_token_ids.extend(tokens)

    @staticmethod
    def logprobs_row_starts(
        sample_rows: np.ndarray, sampled: list[list[int]], num_reqs: int
    ) -> list[int]:
        """Batch row -> its first row among the emitted tokens' logprobs."""
        starts = [0] * num_reqs
        offset = 0
        for row, tokens in zip(sample_rows.tolist(), sampled, strict=True):
            starts[row] = offset
            offset += len(tokens)
        return starts

    def propose_draft_token_ids(
        self, sample_rows: np.ndarray, num_computed_before: np.ndarray
    ) -> list[list[int]] | None:
        """The next step's drafts, one list per batch row (None without a proposer)."""
        if self.drafter is None:
            return None
        batch = self.input_batch
        assert batch is not None
        drafts: list[list[int]] = [[] for _ in range(batch.num_reqs)]
        if not len(sample_rows):
            return drafts
        req_ids = batch.req_ids
        inputs = ProposerInputs(
            rows=sample_rows.astype(np.int64),
            req_ids=[req_ids[row] for row in sample_rows.tolist()],
            token_ids=batch.token_ids_cpu,
            num_tokens=batch.num_tokens,
            num_computed_before=num_computed_before,
            block_table=batch.block_table,
        )
        for row, draft in zip(sample_rows.tolist(), self.drafter.propose(inputs), strict=True):
            drafts[row] = draft
        return drafts
