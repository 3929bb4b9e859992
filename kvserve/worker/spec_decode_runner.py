"""The model runner's side of speculative decoding, as a component it holds.

Each step the scheduled drafts are written into the persistent batch's token rows right
after the request's known tokens (they are not counted in ``num_tokens``), so the normal
input preparation feeds them to the model. A sampling row with n drafts then needs the
logits of its last n + 1 tokens, which the RejectionSampler verifies. After sampling, the
proposer drafts the next step's tokens from the batch as it now stands.

``SpecDecodeRunner`` without a proposer is the no-op form (a NoOpProposer as its drafter,
no drafts are ever scheduled, so verification never runs); ``DraftingSpecDecodeRunner``
adds the proposer.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvserve.sample.rejection_sampler import (
    MetadataFactory,
    RejectionSampler,
    RejectionSamplerOutput,
)
from kvserve.sample.spec_decode_metadata import SpecDecodeMetadata
from kvserve.spec_decode import NoOpProposer, Proposer, ProposerInputs, create_proposer

if TYPE_CHECKING:
    from kvserve.config import EngineConfig
    from kvserve.protocol.scheduler_output import SchedulerOutput
    from kvserve.worker.input_batch import InputBatch
    from kvserve.worker.input_preparation import StepInputs


class SpecDecodeRunner:
    """Verifies scheduled drafts; proposes none (the form without speculative_config)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rejection_sampler = RejectionSampler()
        # The runner calls its hooks (load_model, attention_layers, bind_kv_cache,
        # remove_requests) directly; this form's are no-ops.
        self.drafter: Proposer = NoOpProposer()

    def propose_draft_token_ids(
        self, batch: InputBatch, sample_rows: np.ndarray, num_computed_before: np.ndarray
    ) -> list[list[int]] | None:
        """The next step's drafts, one list per batch row (None: no proposer)."""
        return None

    # Verification of the step's drafts.

    @staticmethod
    def write_spec_tokens(batch: InputBatch, scheduler_output: SchedulerOutput) -> None:
        """Puts each scheduled request's drafts after its known tokens in the batch."""
        for req_id, draft in scheduler_output.scheduled_spec_decode_tokens.items():
            row = batch.req_id_to_index[req_id]
            start = int(batch.num_tokens[row])
            batch.token_ids_cpu[row, start : start + len(draft)] = draft

    def spec_decode_metadata(
        self, batch: InputBatch, scheduler_output: SchedulerOutput, inputs: StepInputs
    ) -> SpecDecodeMetadata | None:
        """Where the drafts' logits are, or None for a step without drafts."""
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        if not spec_tokens:
            return None
        req_ids = batch.req_ids
        drafts = [spec_tokens.get(req_ids[row], []) for row in inputs.sample_rows.tolist()]
        last = inputs.query_start_loc_np[inputs.sample_rows + 1] - 1
        return SpecDecodeMetadata.make(drafts, last, self.device)

    def split_spec_rows(
        self, batch: InputBatch, scheduler_output: SchedulerOutput, inputs: StepInputs
    ) -> None:
        """Attention sees each token of a row with drafts as its own one-token query.

        Token j of such a row attends to the row's first computed + j + 1 positions, which
        is exactly the causal mask of the multi-token query; as one-token queries the step
        stays a decode step (the fused decode kernels run it, as in plain decoding, and
        give the same numbers for every position). Rows without drafts keep their query.
        """
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        if not spec_tokens:
            return
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

    def verify(
        self,
        metadata: SpecDecodeMetadata,
        logits: torch.Tensor,
        sample_rows: np.ndarray,
        make_sampling_metadata: MetadataFactory,
    ) -> RejectionSamplerOutput:
        """The accepted drafts plus one token per sampling row, and their logprobs."""
        return self.rejection_sampler(metadata, None, logits, sample_rows, make_sampling_metadata)

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


class DraftingSpecDecodeRunner(SpecDecodeRunner):
    """With a proposer: drafts after each step."""

    def __init__(self, device: torch.device, drafter: Proposer) -> None:
        super().__init__(device)
        self.drafter = drafter

    def propose_draft_token_ids(
        self, batch: InputBatch, sample_rows: np.ndarray, num_computed_before: np.ndarray
    ) -> list[list[int]] | None:
        drafts: list[list[int]] = [[] for _ in range(batch.num_reqs)]
        if not len(sample_rows):
            return drafts
        req_ids = batch.req_ids
        inputs = ProposerInputs(
            rows=sample_rows.astype(np.int64),
            req_ids=[req_ids[row] for row in sample_rows.tolist()],
            token_ids=batch.token_ids_cpu,
            num_tokens=batch.num_tokens,
            num_prompt_tokens=batch.num_prompt_tokens,
            num_computed_before=num_computed_before,
            block_table=batch.block_table,
        )
        for row, draft in zip(sample_rows.tolist(), self.drafter.propose(inputs), strict=True):
            drafts[row] = draft
        return drafts


def make_spec_decode_runner(config: EngineConfig, device: torch.device) -> SpecDecodeRunner:
    drafter = create_proposer(config, device)
    if drafter is None:
        return SpecDecodeRunner(device)
    return DraftingSpecDecodeRunner(device, drafter)
