"""What the decode attention kernel tests share: a paged cache in shuffled blocks, a call
of a kernel op at a given thread count, and the float64 reference."""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

BLOCK = 16

# n -> (keys, values) as the cache stores them, and as float64 the values they hold.
RowMaker = Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


def paged_cache(
    rng: random.Random, lens: list[int], make_rows: RowMaker, row_shape: tuple[int, int],
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:  # fmt: skip
    """A cache holding each request's rows in shuffled blocks, its block table, and the
    float64 keys and values the cache holds."""
    need = [-(-n // BLOCK) for n in lens]
    pool = list(range(sum(need) + 2))
    rng.shuffle(pool)
    cache = torch.zeros(2, len(pool), BLOCK, *row_shape, dtype=dtype)
    table = torch.zeros(len(lens), max([*need, 1]), dtype=torch.int32)
    keys, values = [], []
    for r, n in enumerate(lens):
        blocks, pool = pool[: need[r]], pool[need[r] :]
        table[r, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        k, v, k_held, v_held = make_rows(n)
        pos = torch.arange(n)
        slots = torch.tensor(blocks, dtype=torch.long)[pos // BLOCK] * BLOCK + pos % BLOCK
        cache[0].view(-1, *row_shape)[slots] = k
        cache[1].view(-1, *row_shape)[slots] = v
        keys.append(k_held)
        values.append(v_held)
    return cache, table, keys, values


def run_kernel(
    op: Callable[..., object], q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor,
    lens: list[int], window: int, threads: int, head: int,
) -> torch.Tensor:  # fmt: skip
    """``op`` (a cache_and_decode_attention kind) on ``threads`` threads, nothing to write."""
    empty = torch.empty(0, cache.shape[3], head)
    out = torch.full_like(q, float("nan"))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        op(
            out, q, empty, empty, cache, torch.empty(0, dtype=torch.long), table,
            torch.tensor(lens, dtype=torch.int32), torch.arange(len(lens)), head**-0.5, window,
        )  # fmt: skip
    finally:
        torch.set_num_threads(before)
    return out


def reference(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], window: int
) -> torch.Tensor:
    """Softmax attention in float64 over each request's last ``window`` positions (0: all)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // keys[0].shape[1]
    for r, (k, v) in enumerate(zip(keys, values, strict=True)):
        first = max(0, len(k) - window) if window > 0 else 0
        if len(k) - first <= 0:
            continue
        k = k[first:].repeat_interleave(group, dim=1)
        v = v[first:].repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,shd->hs", q[r].double(), k) * q.shape[2] ** -0.5
        out[r] = torch.einsum("hs,shd->hd", scores.softmax(-1), v)
    return out
