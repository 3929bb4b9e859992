"""The pooling component on tiny hidden states (no model): chunks fold into the prompt's
vector, and finished requests' partial folds are dropped."""

from __future__ import annotations

import torch

from kvserve.pooling_params import PoolerConfig
from kvserve.sample.sampling_batch import SamplingBatch
from kvserve.sampling_params import SamplingParams
from kvserve.worker.input_batch import InputBatch
from kvserve.worker.input_preparation import InputPreparer
from kvserve.worker.prompt_pooler import PromptPooler
from kvserve.worker.request_state import CachedRequestState

CPU = torch.device("cpu")


def _batch() -> InputBatch:
    batch = InputBatch(4, 16, 32, CPU, [4], SamplingBatch(4, 64, CPU))
    for i in range(2):
        batch.add_request(
            CachedRequestState(f"r{i}", [3, 4, 5, 6], SamplingParams(), None, ([1 + i],), 0)
        )
    return batch


def test_chunks_fold_into_the_mean_and_aborted_folds_are_dropped() -> None:
    pooler = PromptPooler(PoolerConfig("MEAN", normalize=False))
    batch = _batch()
    hidden = torch.randn(8, 4)
    inputs = InputPreparer(4, 32, CPU, False).prepare(batch, {"r0": 2, "r1": 2}, 4)
    assert pooler.pool_step(hidden[:4], batch, inputs) == {}
    assert pooler.pending_req_ids() == {"r0", "r1"}
    pooler.remove_requests({"r1", "unknown"})
    assert pooler.pending_req_ids() == {"r0"}
    batch.remove_request("r1")
    batch.num_computed_tokens_cpu[0] = 2
    inputs = InputPreparer(4, 32, CPU, False).prepare(batch, {"r0": 2}, 2)
    done = pooler.pool_step(hidden[4:6], batch, inputs)
    expected = torch.cat([hidden[:2], hidden[4:6]]).mean(0)
    torch.testing.assert_close(torch.tensor(done["r0"]), expected)
    assert pooler.pending_req_ids() == set()
