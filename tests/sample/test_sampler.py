"""Sampler behaviour on small random logits: greedy, temperature, filters, seeds, logprobs."""

from __future__ import annotations

import torch

from kvserve.sample import Sampler, SamplingBatch, compute_prompt_logprobs
from kvserve.sampling_params import SamplingParams

V = 32
CPU = torch.device("cpu")


def make_batch(
    params: list[SamplingParams],
    seeds: list[int | None] | None = None,
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
    eos: int | None = None,
) -> SamplingBatch:
    batch = SamplingBatch(max_num_reqs=max(8, len(params)), vocab_size=V, device=CPU)
    for row, p in enumerate(params):
        seed = seeds[row] if seeds else None
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        out = outputs[row] if outputs else []
        prompt = prompts[row] if prompts else [0, 1]
        batch.add_request(row, p, prompt, out, gen, eos_token_id=eos)
    return batch


def sample(batch: SamplingBatch, logits: torch.Tensor, rows: torch.Tensor | None = None):
    num_reqs = batch.num_reqs
    return Sampler()(logits.clone(), batch.make_sampling_metadata(num_reqs, rows))


def test_greedy_is_argmax_and_mixed_batch_keeps_greedy_rows_exact() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, V)
    out = sample(make_batch([SamplingParams(temperature=0.0)] * 6), logits)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs_tensors is None

    mixed = [
        SamplingParams(temperature=0.0 if i % 2 else 1.5, top_k=5 * (i % 2 == 0)) for i in range(6)
    ]
    for _ in range(5):
        out = sample(make_batch(mixed), logits)
        assert torch.equal(out.sampled_token_ids[1::2], logits.argmax(-1)[1::2])


def test_temperature_matches_softmax_distribution_empirically() -> None:
    torch.manual_seed(1)
    row = torch.randn(V) * 2
    n = 4000
    logits = row.expand(n, V)
    for temp in (0.5, 2.0):
        batch = SamplingBatch(max_num_reqs=n, vocab_size=V, device=CPU)
        for i in range(n):
            batch.add_request(i, SamplingParams(temperature=temp), [0], [], None)
        torch.manual_seed(123)
        tokens = sample(batch, logits).sampled_token_ids
        freq = torch.bincount(tokens, minlength=V).float() / n
        expected = (row / temp).softmax(-1)
        assert (freq - expected).abs().max() < 0.03
    # Low temperature concentrates mass on the argmax far more than high temperature.
    assert (row / 0.5).softmax(-1).max() > (row / 2.0).softmax(-1).max() + 0.1


def test_top_k_keeps_exactly_k_candidates() -> None:
    torch.manual_seed(2)
    row = torch.randn(V) * 0.1  # nearly flat: every kept token is drawn often
    n = 2000
    batch = make_batch([SamplingParams(temperature=1.0, top_k=4)] * 50)
    seen: set[int] = set()
    for _ in range(n // 50):
        seen |= set(sample(batch, row.expand(50, V)).sampled_token_ids.tolist())
    assert seen == set(row.topk(4).indices.tolist())


def test_top_p_keeps_minimal_nucleus_and_min_p_threshold() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05] + [0.0] * (V - 4))
    logits = probs.clamp_min(1e-30).log()
    for top_p, kept in ((0.4, {0}), (0.75, {0, 1}), (0.85, {0, 1, 2}), (1.0, {0, 1, 2, 3})):
        batch = make_batch([SamplingParams(temperature=1.0, top_p=top_p)] * 64)
        seen: set[int] = set()
        for _ in range(8):
            seen |= set(sample(batch, logits.expand(64, V)).sampled_token_ids.tolist())
        assert seen == kept, top_p
    batch = make_batch([SamplingParams(temperature=1.0, min_p=0.35)] * 64)  # threshold 0.175
    seen = set()
    for _ in range(8):
        seen |= set(sample(batch, logits.expand(64, V)).sampled_token_ids.tolist())
    assert seen == {0, 1}


def test_seeded_rows_reproduce_regardless_of_neighbours_and_position() -> None:
    torch.manual_seed(3)
    row = torch.randn(V)
    p = SamplingParams(temperature=1.0, seed=7)

    def draws(batch: SamplingBatch, at: int, steps: int = 20) -> list[int]:
        n = batch.num_reqs
        return [
            int(
                sample(
                    batch, torch.randn(n, V).index_copy(0, torch.tensor([at]), row[None])
                ).sampled_token_ids[at]
            )
            for _ in range(steps)
        ]

    alone = draws(make_batch([p], seeds=[7]), 0)
    others = [SamplingParams(temperature=1.0)] * 3
    crowded = draws(make_batch([*others, p], seeds=[None, None, None, 7]), 3)
    assert alone == crowded

    # Moving and swapping rows keeps the generator with its request.
    batch = make_batch([p, *others], seeds=[7, None, None, None])
    first = draws(batch, 0, 10)
    batch.swap_requests(0, 2)
    second = draws(batch, 2, 5)
    batch.remove_request(0)
    batch.move_request(2, 0)
    batch.move_request(3, 2)
    third = draws(batch, 0, 5)
    assert first + second + third == alone

    unseeded = make_batch([SamplingParams(temperature=1.0)] * 2)
    a = [sample(unseeded, row.expand(2, V)).sampled_token_ids.tolist() for _ in range(20)]
    assert [x[0] for x in a] != [x[1] for x in a]


def test_partial_prefill_rows_do_not_advance_their_generator() -> None:
    row = torch.randn(V)
    p = SamplingParams(temperature=1.0, seed=11)
    reference = make_batch([p], seeds=[11])
    expect = [int(sample(reference, row[None]).sampled_token_ids[0]) for _ in range(5)]
    batch = make_batch([SamplingParams(temperature=1.0), p], seeds=[None, 11])
    got = []
    for step in range(8):
        if step % 3 == 1:  # row 1 still prefilling: only row 0 samples
            out = sample(batch, torch.randn(1, V), rows=torch.tensor([0]))
            assert out.sampled_token_ids.shape == (1,)
            continue
        got.append(int(sample(batch, torch.stack([torch.randn(V), row])).sampled_token_ids[1]))
    assert got == expect


def test_logprobs_are_raw_with_ranks() -> None:
    torch.manual_seed(4)
    logits = torch.randn(3, V)
    params = [
        SamplingParams(temperature=1.0, logprobs=3, repetition_penalty=1.7, logit_bias={5: 9.0}),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=0.0),
    ]
    out = sample(make_batch(params, outputs=[[1, 2], [3], []]), logits)
    lp = out.logprobs_tensors
    assert lp is not None
    ref = logits.log_softmax(-1)
    tokens = out.sampled_token_ids
    assert lp.logprob_token_ids.shape == (3, 4)
    assert torch.equal(lp.logprob_token_ids[:, 0], tokens)
    torch.testing.assert_close(lp.logprobs[:, 0], ref.gather(1, tokens[:, None])[:, 0])
    top = ref.topk(3)
    assert torch.equal(lp.logprob_token_ids[:, 1:], top.indices)
    torch.testing.assert_close(lp.logprobs[:, 1:], top.values)
    expected_ranks = (ref > ref.gather(1, tokens[:, None])).sum(-1) + 1
    assert torch.equal(lp.selected_token_ranks, expected_ranks)
    assert lp.selected_token_ranks[1] == 1  # greedy without processing: the top token

    whole = sample(make_batch([SamplingParams(temperature=0.0, logprobs=-1)]), logits[:1])
    assert whole.logprobs_tensors is not None
    assert whole.logprobs_tensors.logprobs.shape == (1, V + 1)


def test_compute_prompt_logprobs() -> None:
    torch.manual_seed(5)
    logits = torch.randn(7, V)
    targets = torch.randint(0, V, (7,))
    lp = compute_prompt_logprobs(logits, targets, 2)
    ref = logits.log_softmax(-1)
    assert torch.equal(lp.logprob_token_ids[:, 0], targets)
    torch.testing.assert_close(lp.logprobs[:, 0], ref[torch.arange(7), targets])
    torch.testing.assert_close(lp.logprobs[:, 1:], ref.topk(2).values)
    ranks = (ref > ref[torch.arange(7), targets][:, None]).sum(-1) + 1
    assert torch.equal(lp.selected_token_ranks, ranks)
    assert compute_prompt_logprobs(logits, targets, 0).logprobs.shape == (7, 1)
    assert compute_prompt_logprobs(logits, targets, -1).logprobs.shape == (7, V + 1)


def test_overflowed_or_fully_masked_rows_still_sample_a_token_of_the_vocabulary() -> None:
    """A repetition penalty of 5e-324 (a fuzzed request) divides positive logits to inf;
    the softmax of such a row is NaN, whose inverse-CDF sample was the index V itself,
    and the next step's embedding lookup failed. Its limit is the overflowed tokens
    alone; a row with every token masked samples from the whole vocabulary."""
    logits = torch.full((3, V), -1.0)
    logits[0, [3, 7]] = float("inf")  # overflowed: 3 or 7, nothing else
    logits[1, 5] = float("nan")  # undefined entry: dropped, the rest stays a distribution
    logits[2] = float("-inf")  # nothing allowed
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(3)]
    seen: list[set[int]] = [set(), set(), set()]
    for draw in range(40):
        batch = make_batch(params, seeds=[draw, draw + 100, draw + 200])
        out = sample(batch, logits).sampled_token_ids.tolist()
        for row, token in enumerate(out):
            assert 0 <= token < V
            seen[row].add(token)
    assert seen[0] == {3, 7}
    assert 5 not in seen[1] and len(seen[1]) > 5
    assert len(seen[2]) > 5
