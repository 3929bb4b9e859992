from __future__ import annotations

import torch

from kvserve.sample.sampling_batch import SamplingBatch
from kvserve.sampling_params import SamplingParams
from kvserve.worker.input_batch import InputBatch
from kvserve.worker.request_state import CachedRequestState

VOCAB = 64


def _batch() -> InputBatch:
    device = torch.device("cpu")
    return InputBatch(8, 32, 64, device, [4], SamplingBatch(8, VOCAB, device))


def _request(i: int) -> CachedRequestState:
    generator = torch.Generator().manual_seed(i) if i % 2 else None
    return CachedRequestState(
        req_id=f"r{i}",
        prompt_token_ids=[i * 10 + k for k in range(3 + i)],
        sampling_params=SamplingParams(temperature=0.1 * (i + 1), top_k=i + 1, logprobs=i),
        generator=generator,
        block_ids=([100 + i, 200 + i],),
        num_computed_tokens=i,
        output_token_ids=[50 + i],
        eos_token_id=2,
    )


def _assert_row_consistent(batch: InputBatch, req: CachedRequestState) -> None:
    row = batch.req_id_to_index[req.req_id]
    tokens = req.prompt_token_ids + req.output_token_ids
    assert batch.req_ids[row] == req.req_id
    assert batch.requests[row] is req
    assert batch.num_tokens[row] == len(tokens)
    assert batch.token_ids_cpu[row, : len(tokens)].tolist() == tokens
    assert batch.num_prompt_tokens[row] == len(req.prompt_token_ids)
    assert batch.num_computed_tokens_cpu[row] == req.num_computed_tokens
    assert batch.block_table[0].get_row(row) == req.block_ids[0]
    sb = batch.sampling_batch
    assert sb.params[row] is not None
    assert sb.temperature_cpu[row].item() == torch.tensor(req.sampling_params.temperature).item()
    assert sb.top_k_cpu[row].item() == req.sampling_params.top_k
    assert sb.output_token_ids[row] is req.output_token_ids
    assert (row in sb.generators) == (req.generator is not None)
    if req.generator is not None:
        assert sb.generators[row] is req.generator


def test_add_remove_condense_keeps_rows_consistent() -> None:
    batch = _batch()
    reqs = [_request(i) for i in range(6)]
    for req in reqs:
        batch.add_request(req)
    assert batch.req_ids == [r.req_id for r in reqs]

    assert batch.remove_request("r1") == 1
    assert batch.remove_request("r3") == 3
    assert batch.remove_request("nope") is None
    # A new request reuses the lowest hole.
    extra = _request(7)
    assert batch.add_request(extra) == 1
    batch.condense()
    live = [reqs[0], extra, reqs[2], reqs[4], reqs[5]]
    assert batch.num_reqs == 5
    assert sorted(batch.req_id_to_index.values()) == list(range(5))
    assert batch.sampling_batch.num_reqs == 5
    for req in live:
        _assert_row_consistent(batch, req)
    # Row 3 was filled from the last row; the vacated rows hold no sampling state.
    assert batch.req_ids[3] == "r5"
    assert all(p is None for p in batch.sampling_batch.params[5:])


def test_condense_after_removing_the_tail_and_swap() -> None:
    batch = _batch()
    reqs = [_request(i) for i in range(4)]
    for req in reqs:
        batch.add_request(req)
    batch.remove_request("r0")
    batch.remove_request("r3")
    batch.condense()
    assert batch.req_ids == ["r2", "r1"]
    batch.swap_states(0, 1)
    assert batch.req_ids == ["r1", "r2"]
    for req in reqs[1:3]:
        _assert_row_consistent(batch, req)


def test_append_token_ids_and_metadata_rows() -> None:
    import numpy as np

    batch = _batch()
    reqs = [_request(i) for i in range(3)]
    for req in reqs:
        batch.add_request(req)
    rows = np.array([0, 2])
    batch.append_token_ids(rows, np.array([7, 9], dtype=np.int32))
    assert batch.token_ids_cpu[0, batch.num_tokens[0] - 1] == 7
    assert batch.token_ids_cpu[2, batch.num_tokens[2] - 1] == 9
    assert batch.num_tokens[1] == reqs[1].num_tokens
    meta = batch.sampling_batch.make_sampling_metadata(3, torch.from_numpy(rows))
    assert meta.max_num_logprobs == 2
    assert (
        meta.temperature is not None
        and meta.temperature.tolist() == torch.tensor([0.1, 0.3]).tolist()
    )


def test_append_one_row_as_many_rows_do_up_to_max_model_len() -> None:
    import numpy as np

    one, many = _batch(), _batch()
    for batch in (one, many):
        for req in [_request(i) for i in range(2)]:
            batch.add_request(req)
    room = max(one.max_model_len - int(n) for n in one.num_tokens[:2])
    for step in range(room + 2):  # past max_model_len: tokens are dropped, counts stay
        tokens = np.array([100 + step, 200 + step], dtype=np.int32)
        one.append_token_ids(np.array([0]), tokens[:1])  # the single-row path
        one.append_token_ids(np.array([1]), tokens[1:])
        many.append_token_ids(np.array([0, 1]), tokens)  # the general one
    np.testing.assert_array_equal(one.num_tokens, many.num_tokens)
    np.testing.assert_array_equal(one.token_ids_cpu, many.token_ids_cpu)
    assert one.num_tokens[:2].tolist() == [one.max_model_len] * 2
