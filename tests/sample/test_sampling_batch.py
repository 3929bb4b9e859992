"""SamplingBatch bookkeeping: every row's state follows its request through add/remove/move/swap."""

from __future__ import annotations

import random

import torch

from kvserve.sample import Sampler, SamplingBatch
from kvserve.sample.logits_processor import LogitBiasLogitsProcessor, MinPLogitsProcessor
from kvserve.sampling_params import SamplingParams

V = 16
CPU = torch.device("cpu")
DRAWS: dict[int, torch.Generator] = {}  # req id -> replay of its generator's draws


def check_consistent(
    batch: SamplingBatch, model: dict[int, tuple[int, SamplingParams, list[int]]]
) -> None:
    procs = {type(p): p for p in batch.logitsprocs}
    # Processors see the batch changes when metadata is made.
    batch.make_sampling_metadata(max(model, default=-1) + 1)
    for row in range(batch.max_num_reqs):
        if row not in model:
            assert batch.params[row] is None
            assert row not in batch.generators
            continue
        req_id, params, output = model[row]
        assert batch.params[row] is params
        assert batch.output_token_ids[row] is output
        assert batch.temperature_cpu[row].item() == params.temperature
        assert batch.top_k_cpu[row].item() == (params.top_k or V)
        assert batch.repetition_penalties_cpu[row].item() == params.repetition_penalty
        assert int(torch.randint(0, 10**9, (1,), generator=batch.generators[row])) == req_id_draw(
            req_id
        )
        bias = procs[LogitBiasLogitsProcessor].states.get(row)
        assert bias == params.logit_bias
        min_p = procs[MinPLogitsProcessor].states.get(row)
        assert min_p == (params.min_p or None)
    asked = [p.logprobs for _, p, _ in model.values() if p.logprobs is not None]
    assert batch.max_num_logprobs == max(asked, default=None)


def req_id_draw(req_id: int) -> int:
    # Every check draws once from the request's generator; a fresh one seeded the same way
    # replays the draws, so the k-th check must match the k-th draw of its own seed.
    gen = DRAWS.setdefault(req_id, torch.Generator().manual_seed(req_id))
    return int(torch.randint(0, 10**9, (1,), generator=gen))


def test_random_add_remove_move_swap_keeps_rows_consistent() -> None:
    rng = random.Random(0)
    batch = SamplingBatch(max_num_reqs=6, vocab_size=V, device=CPU)
    model: dict[int, tuple[int, SamplingParams, list[int]]] = {}
    next_id = 1000
    for _ in range(150):
        op = rng.choice(["add", "add", "remove", "condense", "swap"])
        free = [r for r in range(6) if r not in model]
        if op == "add" and free:
            row = min(free)
            params = SamplingParams(
                temperature=rng.choice([0.0, 0.75, 1.0]),
                top_k=rng.choice([0, 3]),
                repetition_penalty=rng.choice([1.0, 1.5]),
                logit_bias=rng.choice([None, {rng.randrange(V): 1.0}]),
                min_p=rng.choice([0.0, 0.25]),
                logprobs=rng.choice([None, 0, 2]),
            )
            output = [rng.randrange(V)]
            batch.add_request(row, params, [1, 2], output, torch.Generator().manual_seed(next_id))
            model[row] = (next_id, params, output)
            next_id += 1
        elif op == "remove" and model:
            row = rng.choice(list(model))
            batch.remove_request(row)
            del model[row]
        elif op == "condense" and model:
            # Like the runner: fill holes from the end so rows 0..n-1 are occupied.
            while free and free[0] < max(model):
                src, dst = max(model), free.pop(0)
                batch.move_request(src, dst)
                model[dst] = model.pop(src)
                free = [r for r in range(6) if r not in model]
        elif op == "swap" and len(model) >= 2:
            a, b = rng.sample(list(model), 2)
            batch.swap_requests(a, b)
            model[a], model[b] = model[b], model[a]
        if rng.random() < 0.5:
            check_consistent(batch, model)
    check_consistent(batch, model)


def test_add_after_move_in_one_step_reaches_processors_in_order() -> None:
    batch = SamplingBatch(max_num_reqs=4, vocab_size=V, device=CPU)
    for row, tok in enumerate((3, 5, 7)):
        batch.add_request(
            row, SamplingParams(temperature=0.0, logit_bias={tok: 50.0}), [0], [], None
        )
    batch.make_sampling_metadata(3)
    # One step: remove row 0, condense row 2 into it, then a new request takes row 2.
    batch.remove_request(0)
    batch.move_request(2, 0)
    batch.add_request(2, SamplingParams(temperature=0.0, logit_bias={9: 50.0}), [0], [], None)
    out = Sampler()(torch.zeros(3, V), batch.make_sampling_metadata(3))
    assert out.sampled_token_ids.tolist() == [7, 5, 9]


def test_metadata_is_reused_until_the_rows_change() -> None:
    batch = SamplingBatch(max_num_reqs=4, vocab_size=V, device=CPU)
    out0: list[int] = []
    batch.add_request(0, SamplingParams(temperature=0.0, frequency_penalty=1.0), [1], out0, None)
    first = batch.make_sampling_metadata(1)
    out0.append(5)  # the runner appends a sampled token to the live list
    again = batch.make_sampling_metadata(1)
    assert again is first and again.output_token_ids == [[5]]
    # The penalty sees the appended token through the reused metadata.
    logits = torch.zeros(1, V)
    logits[0, 5] = 0.5
    assert int(Sampler()(logits, again).sampled_token_ids[0]) != 5

    batch.add_request(1, SamplingParams(temperature=1.0, seed=3), [2], [], None)
    changed = batch.make_sampling_metadata(2)
    assert changed is not first and not changed.all_greedy
    batch.remove_request(1)
    after_remove = batch.make_sampling_metadata(1)
    assert after_remove is not changed and after_remove.all_greedy
    # A step where only some rows sample neither uses nor replaces the reused metadata.
    batch.add_request(1, SamplingParams(temperature=0.0), [2], [], None)
    full = batch.make_sampling_metadata(2)
    partial = batch.make_sampling_metadata(2, torch.tensor([1]))
    assert partial is not full and partial.num_reqs == 2 and len(partial.output_token_ids) == 1
    assert batch.make_sampling_metadata(2) is full
