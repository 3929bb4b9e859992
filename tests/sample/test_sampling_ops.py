"""The batched top-k/top-p kernel on its own."""

from __future__ import annotations

import torch

from kvserve.sample.ops.topk_topp import apply_top_k_top_p


def test_top_k_per_row_keeps_exactly_k_even_with_ties() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    logits[3] = 1.0  # all tied
    k = torch.tensor([1, 7, 50, 5])
    out = apply_top_k_top_p(logits.clone(), k, None)
    assert torch.isfinite(out).sum(-1).tolist() == [1, 7, 50, 5]
    for row in range(3):
        kept = set(torch.isfinite(out[row]).nonzero().flatten().tolist())
        assert kept == set(logits[row].topk(int(k[row])).indices.tolist())
    finite = torch.isfinite(out)
    assert torch.equal(out[finite], logits[finite])  # kept logits are untouched


def test_top_p_keeps_minimal_nucleus_per_row_and_combines_with_top_k() -> None:
    torch.manual_seed(1)
    logits = torch.randn(6, 40) * 2
    p = torch.tensor([0.1, 0.3, 0.5, 0.9, 0.99, 1.0])
    out = apply_top_k_top_p(logits.clone(), None, p)
    probs = logits.softmax(-1)
    for row in range(6):
        sorted_probs = probs[row].sort(descending=True).values
        # Minimal nucleus: the fewest top tokens whose mass reaches p.
        need = int((sorted_probs.cumsum(0) < p[row]).sum()) + 1
        assert int(torch.isfinite(out[row]).sum()) == min(need, 40)
    both = apply_top_k_top_p(logits.clone(), torch.tensor([2] * 6), torch.tensor([0.99] * 6))
    assert torch.isfinite(both).sum(-1).tolist() == [2] * 6


def test_partial_topk_path_matches_full_sort_path() -> None:
    torch.manual_seed(2)
    logits = torch.randn(3, 64)
    k = torch.tensor([3, 10, 6])
    p = torch.tensor([0.5, 0.8, 1.0])
    partial = apply_top_k_top_p(logits.clone(), k, p)  # all rows have a top-k: topk path
    with_disabled = torch.cat((logits, logits[:1]))
    full = apply_top_k_top_p(
        with_disabled, torch.cat((k, torch.tensor([64]))), torch.cat((p, p[:1]))
    )
    assert torch.equal(partial, full[:3])


def test_random_sample_never_picks_masked_tokens_and_follows_the_weights() -> None:
    from kvserve.sample.ops.topk_topp import random_sample

    torch.manual_seed(0)
    probs = torch.zeros(4000, 50)
    probs[:, [3, 17, 49]] = torch.tensor([1.0, 2.0, 5.0])  # unnormalized weights
    sampled = random_sample(probs, {})
    assert set(sampled.tolist()) <= {3, 17, 49}
    counts = torch.bincount(sampled, minlength=50)[[3, 17, 49]].float() / 4000
    torch.testing.assert_close(counts, torch.tensor([1.0, 2.0, 5.0]) / 8, atol=0.03, rtol=0)
    # A row's own generator decides its draw, whatever the other rows do.
    gen_a, gen_b = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    first = random_sample(probs[:3].clone(), {1: gen_a})[1]
    again = random_sample(probs[:5].clone(), {1: gen_b})[1]
    assert first == again
