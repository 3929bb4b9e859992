"""The logits component on tiny tensors (no model): grammar masks land on the right logits
rows, logprobs spread over batch rows, prompt logprobs by chunk."""

from __future__ import annotations

import numpy as np
import torch

from kvserve.protocol.runner_output import LogprobsTensors
from kvserve.protocol.scheduler_output import GrammarOutput
from kvserve.sample.sampling_batch import SamplingBatch
from kvserve.sampling_params import SamplingParams
from kvserve.worker.input_batch import InputBatch
from kvserve.worker.input_preparation import InputPreparer
from kvserve.worker.logits_runner import LogitsRunner
from kvserve.worker.request_state import CachedRequestState

VOCAB = 32
CPU = torch.device("cpu")


def _batch(*params: SamplingParams) -> InputBatch:
    batch = InputBatch(4, 16, 32, CPU, [4], SamplingBatch(4, VOCAB, CPU))
    for i, p in enumerate(params):
        batch.add_request(CachedRequestState(f"r{i}", [3 + i, 4, 5, 6], p, None, ([1 + i],), 0))
    return batch


def test_grammar_mask_reaches_the_constrained_row_only() -> None:
    batch = _batch(SamplingParams(), SamplingParams())
    logits = torch.zeros(2, VOCAB)
    # r1 may only emit token 3 (bit 3 of word 0).
    bitmask = np.zeros((1, VOCAB // 32), dtype=np.int32)
    bitmask[0, 0] = 1 << 3
    LogitsRunner.apply_grammar_bitmask(
        batch, logits, np.array([0, 1]), GrammarOutput(["r1"], bitmask)
    )
    assert torch.isfinite(logits[0]).all()
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [3]


def test_logprobs_by_row_fills_the_rows_that_did_not_sample_with_zeros() -> None:
    tensors = LogprobsTensors(
        torch.tensor([[7, 1]]), torch.tensor([[-0.5, -1.0]]), torch.tensor([2])
    )
    lists = LogitsRunner.logprobs_by_row(tensors, np.array([1]), 3)
    assert lists.logprob_token_ids == [[0, 0], [7, 1], [0, 0]]
    assert lists.sampled_token_ranks == [0, 2, 0]


def test_prompt_logprobs_by_chunk_then_done() -> None:
    batch = _batch(SamplingParams(prompt_logprobs=2), SamplingParams())
    runner = LogitsRunner(VOCAB)
    assert runner.wants_prompt_logprobs(batch)
    inputs = InputPreparer(4, 32, CPU, False).prepare(batch, {"r0": 2, "r1": 4}, 6)
    hidden = torch.randn(6, VOCAB)

    class IdentityLogits:
        """A model whose hidden states are its logits."""

        def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
            return hidden_states

    identity_logits = IdentityLogits()

    assert runner.prompt_logprobs(batch, inputs, None, identity_logits) == {}
    got = runner.prompt_logprobs(batch, inputs, hidden, identity_logits)
    assert set(got) == {"r0"}
    lp = got["r0"]
    assert lp is not None and lp.logprobs.shape == (2, 3)
    # Position p scores prompt token p + 1.
    expected = hidden[:2].log_softmax(-1)[[0, 1], [4, 5]]
    torch.testing.assert_close(lp.logprobs[:, 0], expected)
    # The last chunk (positions 2, 3) scores only token 3: the prompt has 4 tokens.
    batch.num_computed_tokens_cpu[0] = 2
    inputs = InputPreparer(4, 32, CPU, False).prepare(batch, {"r0": 2, "r1": 1}, 3)
    last = runner.prompt_logprobs(batch, inputs, hidden[:3], identity_logits)["r0"]
    assert last is not None and last.logprobs.shape[0] == 1
    assert not runner.wants_prompt_logprobs(batch)
