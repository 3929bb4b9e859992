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
    """Samples one token per row of probs [N, V] as argmax(probs / Exponential(1) noise).

    Rows listed in generators draw their noise from their own generator, so a seeded request
    gets the same token wherever it sits in the batch; the others share the default one."""
    noise = torch.empty_like(probs)
    if len(generators) != probs.shape[0]:
        noise.exponential_()
    for row, generator in generators.items():
        noise[row].exponential_(generator=generator)
    return probs.div_(noise).argmax(dim=-1).view(-1)
