"""Batched top-k / top-p masking and the exponential-race sampler."""

from __future__ import annotations

import torch


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Masks logits [N, V] outside each row's top_k tokens and its top_p nucleus with -inf.

    top_k: int64 [N], vocab_size (or more) where disabled. top_p: float [N], 1.0 where disabled.
    Top-k keeps exactly k tokens (ties broken by sort order); top-p then keeps the minimal set
    of top tokens whose renormalized probability reaches p; the top token always survives."""
    if top_k is None and top_p is None:
        return logits
    vocab_size = logits.shape[1]
    max_k = vocab_size if top_k is None else int(top_k.max().clamp(1, vocab_size))
    if max_k < vocab_size:
        # Every row has a top-k: the candidates are the max_k best, no full sort needed.
        cand, order = logits.topk(max_k, dim=-1)
    else:
        cand, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        positions = torch.arange(max_k, device=logits.device).unsqueeze(0)
        cand.masked_fill_(positions >= top_k.clamp(1, vocab_size).unsqueeze(1), float("-inf"))
    if top_p is not None:
        probs = cand.softmax(dim=-1)
        # Drop a token when the strictly more likely tokens already reach p.
        mass_above = probs.cumsum(dim=-1) - probs
        cand.masked_fill_(mass_above >= top_p.to(probs.dtype).unsqueeze(1), float("-inf"))
    if max_k == vocab_size:
        return logits.scatter_(1, order, cand)
    return logits.fill_(float("-inf")).scatter_(1, order, cand)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Samples one token per row of probs [N, V] (unnormalized is fine) by inverse CDF: the
    first token whose cumulative probability exceeds u * total, u ~ U[0, 1).

    One uniform per row instead of vLLM's exponential race over the whole vocabulary
    (which costs an exponential per vocabulary entry: ~30 ms per step at 32 rows on a CPU).
    Rows listed in generators draw u from their own generator, so a seeded request gets
    the same token wherever it sits in the batch; the others share the default one."""
    num_rows, vocab = probs.shape
    u = torch.empty(num_rows, dtype=torch.float32, device=probs.device)
    if len(generators) != num_rows:
        u.uniform_()
    for row, generator in generators.items():
        u[row : row + 1].uniform_(generator=generator)
    # In place (callers pass a fresh softmax). Adding a zero leaves a running sum exactly
    # unchanged, so tokens masked by top-k/top-p can never be picked.
    cdf = probs.float().cumsum_(dim=-1)
    total = cdf[:, -1:].contiguous()
    sampled = torch.searchsorted(cdf, u.unsqueeze(1) * total, right=True)
    # u * total can round up to total itself; such a row takes the last token with mass.
    last = torch.searchsorted(cdf, total, right=False)
    return torch.where(sampled < vocab, sampled, last).view(-1)
