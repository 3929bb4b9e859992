"""The output heads on tiny hidden states (no model loaded): the generating head projects
exactly the rows that sample or verify, the pooling head returns the completed prompts'
vectors and forgets aborted folds, an earlier pipeline stage's head returns nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.config import ModelConfig
from kvserve.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from kvserve.pooling_params import PoolerConfig
from kvserve.sample.sampling_batch import SamplingBatch
from kvserve.sample.spec_decode_metadata import SpecDecodeMetadata
from kvserve.sampling_params import SamplingParams
from kvserve.worker.input_batch import InputBatch
from kvserve.worker.input_preparation import InputPreparer, StepInputs
from kvserve.worker.output_head import (
    IntermediateStageHead,
    LogitsHead,
    PoolingHead,
    make_output_head,
)
from kvserve.worker.request_state import CachedRequestState

CPU = torch.device("cpu")
HIDDEN, VOCAB = 4, 8
PROMPT = [3, 4, 5, 6]


@pytest.fixture
def lm_head() -> ParallelLMHead:
    head = ParallelLMHead(VOCAB, HIDDEN)
    with torch.no_grad():
        head.weight.copy_(torch.arange(VOCAB * HIDDEN, dtype=torch.float32).view(VOCAB, HIDDEN))
    return head


def _batch(outputs: list[list[int]]) -> InputBatch:
    """One request per entry, the prompt computed when it already has output tokens."""
    batch = InputBatch(4, 16, 32, CPU, [4], SamplingBatch(4, VOCAB, CPU))
    for i, out in enumerate(outputs):
        state = CachedRequestState(
            f"r{i}", list(PROMPT), SamplingParams(), None, ([1 + i],), len(PROMPT) if out else 0
        )
        state.output_token_ids.extend(out)
        batch.add_request(state)
    return batch


def _inputs(batch: InputBatch, scheduled: dict[str, int]) -> StepInputs:
    return InputPreparer(4, 32, CPU, False).prepare(batch, scheduled, sum(scheduled.values()))


def test_pure_decode_projects_every_row(lm_head: ParallelLMHead) -> None:
    batch = _batch([[9], [10]])
    inputs = _inputs(batch, {"r0": 1, "r1": 1})
    hidden = torch.randn(2, HIDDEN)
    logits, pooled = LogitsHead().compute(lm_head, hidden, batch, inputs, None)
    assert logits is not None and pooled == {}
    torch.testing.assert_close(logits, hidden @ lm_head.weight.T)


def test_prefill_projects_only_the_rows_that_sample(lm_head: ParallelLMHead) -> None:
    # r0 runs half its prompt (no token yet), r1 its whole prompt (samples at its end).
    batch = _batch([[], []])
    inputs = _inputs(batch, {"r0": 2, "r1": 4})
    hidden = torch.randn(6, HIDDEN)
    logits, pooled = LogitsHead().compute(lm_head, hidden, batch, inputs, None)
    assert logits is not None and pooled == {}
    assert logits.shape == (1, VOCAB)
    torch.testing.assert_close(logits[0], lm_head.weight @ hidden[5])


def test_no_sampling_row_gives_no_logits(lm_head: ParallelLMHead) -> None:
    batch = _batch([[], []])
    inputs = _inputs(batch, {"r0": 2, "r1": 3})
    logits, pooled = LogitsHead().compute(lm_head, torch.randn(5, HIDDEN), batch, inputs, None)
    assert logits is None and pooled == {}


def test_drafts_project_the_rows_the_spec_metadata_names(lm_head: ParallelLMHead) -> None:
    # r0 decodes its last token plus two drafts: three positions to score.
    batch = _batch([[9]])
    inputs = _inputs(batch, {"r0": 3})
    spec = SpecDecodeMetadata.make([[7, 8]], np.array([2]), CPU)
    hidden = torch.randn(3, HIDDEN)
    logits, pooled = LogitsHead().compute(lm_head, hidden, batch, inputs, spec)
    assert logits is not None and pooled == {}
    torch.testing.assert_close(logits, hidden @ lm_head.weight.T)
    # Not only the one sampling row's last position, as without drafts.
    assert logits.shape == (3, VOCAB) and len(inputs.sample_rows) == 1


def test_pooling_head_returns_finished_prompts_and_forgets_aborted_folds(
    lm_head: ParallelLMHead,
) -> None:
    head = PoolingHead(PoolerConfig("MEAN", normalize=False))
    batch = _batch([[], []])
    hidden = torch.randn(6, HIDDEN)
    logits, pooled = head.compute(
        lm_head, hidden[:4], batch, _inputs(batch, {"r0": 2, "r1": 2}), None
    )
    assert logits is None and pooled == {}
    assert head.prompt_pooler.pending_req_ids() == {"r0", "r1"}
    # The runner's loop over request-state owners reaches the pooler through the head.
    head.remove_requests({"r1"})
    assert head.prompt_pooler.pending_req_ids() == {"r0"}
    batch.remove_request("r1")
    batch.num_computed_tokens_cpu[0] = 2
    logits, pooled = head.compute(lm_head, hidden[4:6], batch, _inputs(batch, {"r0": 2}), None)
    assert logits is None and set(pooled) == {"r0"}
    expected = torch.cat([hidden[:2], hidden[4:6]]).mean(0)
    torch.testing.assert_close(torch.tensor(pooled["r0"]), expected)
    assert head.prompt_pooler.pending_req_ids() == set()


def test_earlier_stage_returns_nothing_even_when_rows_sample(lm_head: ParallelLMHead) -> None:
    batch = _batch([[9], [10]])
    inputs = _inputs(batch, {"r0": 1, "r1": 1})
    head = IntermediateStageHead()
    assert head.compute(lm_head, torch.randn(2, HIDDEN), batch, inputs, None) == (None, {})
    head.remove_requests({"r0"})  # nothing kept, nothing to forget


def test_the_head_follows_the_runner_kind_and_the_stage() -> None:
    generate = ModelConfig()
    pooling = ModelConfig(runner="pooling", pooler_config=PoolerConfig("MEAN"))
    assert type(make_output_head(generate, is_last_stage=True)) is LogitsHead
    head = make_output_head(pooling, is_last_stage=True)
    assert isinstance(head, PoolingHead)
    assert head.prompt_pooler.pooler.config.pooling_type == "MEAN"
    # An earlier stage never computes logits nor pools, whatever the model.
    for config in (generate, pooling):
        assert type(make_output_head(config, is_last_stage=False)) is IntermediateStageHead
