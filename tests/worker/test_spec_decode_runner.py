"""The spec-decode component on a tiny persistent batch (no model): drafts written after
the known tokens, where their logits are, one-token queries for rows with drafts, the
proposer's drafts per row, and the no-op form without a proposer."""

from __future__ import annotations

import numpy as np
import torch

from kvserve.protocol.scheduler_output import SchedulerOutput
from kvserve.sample.sampling_batch import SamplingBatch
from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode import Proposer, ProposerInputs
from kvserve.worker.input_batch import InputBatch
from kvserve.worker.input_preparation import InputPreparer
from kvserve.worker.request_state import CachedRequestState
from kvserve.worker.spec_decode_runner import DraftingSpecDecodeRunner, SpecDecodeRunner

CPU = torch.device("cpu")


class FakeProposer(Proposer):
    """Drafts the row's last token twice; records what it was asked."""

    def __init__(self) -> None:  # no config: the base class would need one
        self.seen: ProposerInputs | None = None

    def propose(self, inputs: ProposerInputs) -> list[list[int]]:
        self.seen = inputs
        return [[int(inputs.token_ids[r, inputs.num_tokens[r] - 1])] * 2 for r in inputs.rows]


def _batch() -> InputBatch:
    batch = InputBatch(4, 16, 32, CPU, [4], SamplingBatch(4, 64, CPU))
    for i, prompt in enumerate(([5, 6, 7], [8, 9])):
        batch.add_request(
            CachedRequestState(
                req_id=f"r{i}",
                prompt_token_ids=prompt,
                sampling_params=SamplingParams(temperature=0.0),
                generator=None,
                block_ids=([1 + 2 * i, 2 + 2 * i],),
                num_computed_tokens=len(prompt) - 1,
                output_token_ids=[],
            )
        )
    return batch


def _step(drafts: dict[str, list[int]]) -> SchedulerOutput:
    out = SchedulerOutput.empty()
    out.num_scheduled_tokens = {"r0": 1 + len(drafts.get("r0", [])), "r1": 1}
    out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
    out.scheduled_spec_decode_tokens = drafts
    return out


def test_drafts_are_written_after_the_known_tokens_and_verified_rows_split() -> None:
    batch, runner = _batch(), SpecDecodeRunner(CPU)
    step = _step({"r0": [40, 41]})
    runner.write_spec_tokens(batch, step)
    assert batch.token_ids_cpu[0, :5].tolist() == [5, 6, 7, 40, 41]
    assert batch.num_tokens[0] == 3  # drafts are not known tokens
    inputs = InputPreparer(4, 32, CPU, False).prepare(
        batch, step.num_scheduled_tokens, step.total_num_scheduled_tokens
    )
    metadata = runner.spec_decode_metadata(batch, step, inputs)
    assert metadata is not None
    assert metadata.logits_indices.tolist() == [0, 1, 2, 3]  # r0's 3 positions, r1's last
    runner.split_spec_rows(batch, step, inputs)
    common = inputs.common_attn_metadata[0]
    # r0 becomes three one-token queries (seeing 3, 4, 5 positions), r1 stays one query.
    assert common.num_reqs == 4 and common.max_query_len == 1
    assert common.seq_lens_cpu.tolist() == [3, 4, 5, 2]
    assert common.block_table_tensor[:, 0].tolist() == [1, 1, 1, 3]


def test_step_without_drafts_leaves_inputs_alone() -> None:
    batch, runner = _batch(), SpecDecodeRunner(CPU)
    step = _step({})
    inputs = InputPreparer(4, 32, CPU, False).prepare(batch, step.num_scheduled_tokens, 2)
    before = inputs.common_attn_metadata
    assert runner.spec_decode_metadata(batch, step, inputs) is None
    runner.split_spec_rows(batch, step, inputs)
    assert inputs.common_attn_metadata is before


def test_no_op_form_has_no_drafts_nor_layers() -> None:
    runner = SpecDecodeRunner(CPU)
    runner.drafter.load_model()
    runner.drafter.remove_requests({"r0"})
    assert runner.drafter.attention_layers() == {}
    assert runner.propose_draft_token_ids(_batch(), np.array([0, 1]), np.zeros(4)) is None


def test_drafting_form_proposes_per_row() -> None:
    proposer = FakeProposer()
    runner = DraftingSpecDecodeRunner(CPU, proposer)
    assert runner.drafter is proposer
    batch = _batch()
    computed = batch.num_computed_tokens_cpu.copy()
    drafts = runner.propose_draft_token_ids(batch, np.array([1]), computed)
    assert drafts == [[], [9, 9]]
    assert proposer.seen is not None and proposer.seen.req_ids == ["r1"]
    no_rows = np.array([], dtype=np.int64)
    assert runner.propose_draft_token_ids(batch, no_rows, computed) == [[], []]


def test_logprobs_row_starts() -> None:
    starts = SpecDecodeRunner.logprobs_row_starts(np.array([0, 2]), [[1, 2, 3], [4]], 3)
    assert starts == [0, 0, 3]
