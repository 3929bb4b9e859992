"""Random paged-attention steps run through the Triton backend and the CPU backend (the
reference), shared by the interpreter tests and the CUDA ones.

A step is a mixed batch (decodes, whole prefills, chunked prefills after cached tokens)
over shuffled block tables with -1 padding; block 0 is the null block, filled with huge
values, and stands in for every block that no query of a windowed/chunked layer sees (as
the windowed KV cache managers leave them): only the kernel's mask may keep it out.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from kvserve.attention.backends.abstract import AttentionBackend
from kvserve.attention.backends.cpu_attn import CPUAttentionBackend
from kvserve.attention.backends.triton_attn import TritonAttentionBackend
from kvserve.attention.backends.utils import make_common_attn_metadata, visible_keys

NULL_BLOCK = 0


@dataclass(frozen=True)
class Case:
    num_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 16
    block_size: int = 4
    window: int | None = None
    chunk: int | None = None
    sinks: int = 0
    soft_cap: float | None = None
    causal: bool = True
    cache_dtype: torch.dtype = torch.float32


def _unseen(case: Case, first_q: int, seq_len: int, block: int) -> bool:
    """Whether no query position in [first_q, seq_len) sees any key of ``block``."""
    if not case.causal:
        return False
    bs = case.block_size
    k_pos = torch.arange(block * bs, min((block + 1) * bs, seq_len))
    q_pos = torch.arange(first_q, seq_len)
    seen = visible_keys(q_pos[:, None], k_pos[None, :], case.window, case.chunk, case.sinks)
    return not bool(seen.any())


def run_case(
    case: Case,
    query_lens: list[int],
    computed: list[int],
    seed: int,
    device: str,
    atol: float = 1e-5,
    backend_under_test: type[AttentionBackend] = TritonAttentionBackend,
    dtype: torch.dtype | None = None,
) -> None:
    """One step through both backends on identical caches: the Triton output (or
    ``backend_under_test``'s) must match the CPU backend's within ``atol`` and both must
    leave the same cache behind. ``dtype`` (bfloat16, float16) rounds the step's
    query/key/value to it: the tested backend computes in it, the CPU one in float32."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    bs = case.block_size
    seq_lens = [c + n for c, n in zip(computed, query_lens, strict=True)]
    needed = [-(-s // bs) for s in seq_lens]
    pool = list(range(1, sum(needed) + 1))
    rng.shuffle(pool)
    tables: list[list[int]] = []
    for n in needed:
        tables.append(pool[:n])
        pool = pool[n:]
    shape = CPUAttentionBackend.get_kv_cache_shape(
        sum(needed) + 1, bs, case.num_kv_heads, case.head_size
    )
    assert (
        TritonAttentionBackend.get_kv_cache_shape(
            sum(needed) + 1, bs, case.num_kv_heads, case.head_size
        )
        == shape
    )
    kv_cache = torch.randn(shape).to(case.cache_dtype)
    kv_cache[:, NULL_BLOCK] = 1e4
    for r, c in enumerate(computed):
        for b in range(needed[r]):
            # A block of cached tokens nobody looks at any more is the null block now
            # (blocks holding this step's tokens are written, so they stay real).
            if (b + 1) * bs <= c and _unseen(case, c, seq_lens[r], b):
                tables[r][b] = NULL_BLOCK
    common = make_common_attn_metadata(query_lens, computed, tables, bs)
    # -1 padding past each row's blocks, as the model runner's table holds.
    width = common.block_table_tensor.shape[1] + 2
    table = torch.full((len(tables), width), -1, dtype=torch.int32)
    for r, row in enumerate(tables):
        table[r, : len(row)] = torch.tensor(row, dtype=torch.int32)
    common.block_table_tensor = table
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, case.num_heads, case.head_size)
    # K/V as strided views of a fused projection, the way the model hands them over.
    kv = torch.randn(num_tokens, 2, case.num_kv_heads, case.head_size)
    key, value = kv[:, 0], kv[:, 1]
    if dtype is not None:
        query, key, value = (t.to(dtype).float() for t in (query, key, value))

    outputs, caches = [], []
    for backend, dev in ((CPUAttentionBackend, "cpu"), (backend_under_test, device)):
        impl = backend.get_impl_cls()(
            case.num_heads, case.head_size, case.head_size**-0.5, case.num_kv_heads,
            case.window, case.chunk, case.soft_cap,
        )  # fmt: skip
        impl.num_sink_tokens = case.sinks
        impl.causal = case.causal
        md_common = common
        if dev != "cpu":
            md_common = make_common_attn_metadata(query_lens, computed, tables, bs, device=dev)
            md_common.block_table_tensor = table.to(dev)
        md = backend.get_builder_cls()(bs, dev).build(md_common)
        cache = kv_cache.clone().to(dev)
        step_dtype = dtype if dtype is not None and backend is not CPUAttentionBackend else None
        q, k, v = (t.to(dev, step_dtype) for t in (query, key, value))
        out = impl.forward(torch.nn.Module(), q, k, v, cache, md).float()
        outputs.append(out.cpu())
        caches.append(cache.cpu())
    torch.testing.assert_close(outputs[1], outputs[0], atol=atol, rtol=atol)
    assert torch.equal(caches[1], caches[0])
