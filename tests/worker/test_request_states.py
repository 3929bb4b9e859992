"""The request-state table is the one writer of output tokens: each write keeps the state's
list (shared with the SamplingBatch), the batch's token row and its length together."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.protocol.scheduler_output import NewRequestData
from kvserve.sample.sampling_batch import SamplingBatch
from kvserve.sampling_params import SamplingParams
from kvserve.worker.input_batch import InputBatch
from kvserve.worker.request_state import CachedRequestState
from kvserve.worker.request_states import RequestStates

MAX_LEN = 12


def _table(*prompts: list[int]) -> tuple[RequestStates, InputBatch]:
    device = torch.device("cpu")
    batch = InputBatch(4, MAX_LEN, 32, device, [4], SamplingBatch(4, 64, device))
    states = RequestStates(device, eos_token_id=2)
    states.bind_batch(batch)
    for i, prompt in enumerate(prompts):
        new = NewRequestData(f"r{i}", prompt, SamplingParams(seed=i), ([1],), 0)
        batch.add_request(states.add(new))
    return states, batch


def _assert_mirrored(batch: InputBatch, state: CachedRequestState) -> None:
    row = batch.req_id_to_index[state.req_id]
    tokens = (state.prompt_token_ids + state.output_token_ids)[:MAX_LEN]
    assert batch.num_tokens[row] == len(tokens)
    assert batch.token_ids_cpu[row, : len(tokens)].tolist() == tokens
    assert batch.sampling_batch.output_token_ids[row] is state.output_token_ids


def test_add_builds_state_with_its_generator_and_eos() -> None:
    states, _ = _table([5, 6, 7])
    state = states["r0"]
    assert "r0" in states and len(states) == 1
    assert state.eos_token_id == 2 and state.generator is not None
    assert state.prompt_token_ids == [5, 6, 7] and state.output_token_ids == []


def test_append_sampled_one_token_per_row() -> None:
    states, batch = _table([5, 6, 7], [8, 9])
    by_row: list[list[int]] = [[], []]
    states.append_sampled(np.array([0, 1]), np.array([40, 41], dtype=np.int32), by_row)
    assert by_row == [[40], [41]] and all(type(t[0]) is int for t in by_row)
    states.append_sampled(np.array([1]), np.array([42], dtype=np.int32), by_row)
    assert states["r0"].output_token_ids == [40]
    assert states["r1"].output_token_ids == [41, 42]
    for req_id in ("r0", "r1"):
        _assert_mirrored(batch, states[req_id])


def test_append_sampled_lists_clips_the_mirror_at_max_model_len() -> None:
    states, batch = _table(list(range(3, 13)))  # 10 of 12 positions
    by_row: list[list[int]] = [[]]
    states.append_sampled_lists(np.array([0]), [[20, 21, 22]], by_row)
    assert by_row == [[20, 21, 22]]
    state = states["r0"]
    assert state.output_token_ids == [20, 21, 22]  # the scheduler finishes it
    assert batch.num_tokens[0] == MAX_LEN
    _assert_mirrored(batch, state)


def test_take_new_token_ids_appends_only_the_unknown_tail() -> None:
    states, batch = _table([5, 6, 7])
    state = states["r0"]
    # A pipeline stage: the step computed the prompt; the last stage sampled 30.
    state.num_computed_tokens = 3
    states.take_new_token_ids(state, [30])
    states.take_new_token_ids(state, [30])  # already known: nothing new
    assert state.output_token_ids == [30]
    _assert_mirrored(batch, state)
    # Out of the batch (preempted) the state still learns its tokens.
    batch.remove_request("r0")
    state.num_computed_tokens = 4
    states.take_new_token_ids(state, [31])
    assert state.output_token_ids == [30, 31]


def test_truncate_keeps_the_list_object_and_rebuilds_the_row() -> None:
    states, batch = _table([5, 6, 7])
    state = states["r0"]
    for token in (40, 41):
        states.append_sampled(np.array([0]), np.array([token], dtype=np.int32), [[]])
    live = state.output_token_ids
    assert not states.truncate(state, 2)
    assert "r0" in batch.req_id_to_index
    assert states.truncate(state, 1)
    assert state.output_token_ids is live and live == [40]
    assert "r0" not in batch.req_id_to_index  # re-added from the state by the runner
    batch.add_request(state)
    _assert_mirrored(batch, state)


def test_remove_requests_drops_state_and_row() -> None:
    states, batch = _table([5, 6], [7, 8])
    states.remove_requests({"r0", "unknown"})
    assert "r0" not in states and "r1" in states
    assert list(batch.req_id_to_index) == ["r1"]


def test_unbound_table_refuses_to_write() -> None:
    states = RequestStates(torch.device("cpu"), None)
    with pytest.raises(RuntimeError, match="initialize_kv_cache"):
        states.remove_requests({"r0"})
