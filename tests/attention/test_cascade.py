"""Cascade attention (attention/backends/cascade.py): the log-sum-exp merge, the cost
rule, and the CPU backend's decode rows split at a shared prefix vs row by row."""

from __future__ import annotations

import argparse
import random
from typing import Any

import pytest
import torch

from kvserve import _custom_ops as ops
from kvserve.args.engine_args import EngineArgs
from kvserve.attention.backends.cascade import (
    MIN_COMMON_PREFIX_LEN,
    MIN_DECODE_ROWS,
    attention_with_lse,
    forced,
    merge_attn_states,
    use_cascade_attention,
)
from kvserve.attention.backends.cpu_attn import CPUAttentionImpl, CPUAttentionMetadataBuilder
from kvserve.attention.backends.utils import make_common_attn_metadata
from kvserve.benchmarks.cascade import shared_prefix_prompts
from kvserve.sampling_params import SamplingParams
from tests.reference import assert_no_leak, hf_reference

NUM_HEADS, NUM_KV_HEADS, HEAD = 6, 2, 16


@pytest.mark.parametrize("fused", [True, False])
def test_merge_of_two_key_sets_equals_one_softmax(fused: bool) -> None:
    """Attention over keys [0, n) and [n, L) separately, merged by their log-sum-exps,
    equals one softmax over all L keys; the second set masked per batch row as the
    suffix is."""
    torch.manual_seed(0)
    b, h, lq, hd, n, total = 3, 4, 5, 16, 37, 50
    q = torch.randn(b, h, lq, hd)
    k, v = torch.randn(b, h, total, hd), torch.randn(b, h, total, hd)
    keep = torch.tensor([13, 1, 5])  # keys of the second set each row sees
    mask = torch.zeros(b, 1, 1, total - n)
    mask.masked_fill_(torch.arange(total - n)[None, :] >= keep[:, None, None, None], float("-inf"))
    scale = hd**-0.5
    out1, lse1 = attention_with_lse(q, k[:, :, :n], v[:, :, :n], scale, fused=fused)
    out2, lse2 = attention_with_lse(q, k[:, :, n:], v[:, :, n:], scale, mask, fused=fused)
    merged = merge_attn_states(out1, lse1, out2, lse2)

    scores = (q @ k.transpose(-1, -2)).double() * scale
    scores[..., n:] += mask.double()
    expected = (scores.softmax(-1) @ v.double()).float()
    torch.testing.assert_close(merged, expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(
        torch.logaddexp(lse1, lse2), torch.logsumexp(scores, -1).float(), atol=1e-5, rtol=1e-6
    )


def test_cost_rule() -> None:
    # Against the C++ decode kernel it never won at two threads: off by default there.
    assert not use_cascade_attention(2048, 64)
    assert not use_cascade_attention(16384, MIN_DECODE_ROWS)
    assert use_cascade_attention(2048, 64, vs_decode_kernel=False)
    assert not use_cascade_attention(MIN_COMMON_PREFIX_LEN - 16, 1024)  # prefix too short
    assert not use_cascade_attention(1 << 16, MIN_DECODE_ROWS - 1)  # too few rows
    assert not use_cascade_attention(992, 32)  # measured slower than the C++ kernel
    assert use_cascade_attention(256, MIN_DECODE_ROWS, vs_decode_kernel=False)
    assert not use_cascade_attention(240, 64, vs_decode_kernel=False)
    with forced():
        assert use_cascade_attention(992, 32) and use_cascade_attention(16, 1)
        assert not use_cascade_attention(0, 32)
    assert not use_cascade_attention(992, 32)


def _setup(
    rng: random.Random,
    prefix_len: int,
    query_lens: list[int],
    computed: list[int],
    block_size: int,
    cache_dtype: torch.dtype,
) -> tuple[list[list[int]], torch.Tensor, list[torch.Tensor], list[torch.Tensor], int]:
    """Block tables whose first prefix_len // block_size blocks are one physical prefix,
    a cache holding every request's computed keys, and each request's full K/V."""
    nbp = prefix_len // block_size
    seq_lens = [c + q for c, q in zip(computed, query_lens, strict=True)]
    own = [-(-s // block_size) - nbp for s in seq_lens]
    num_blocks = nbp + sum(own) + 2
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    prefix_ids, pool = pool[:nbp], pool[nbp:]
    tables = []
    for n in own:
        tables.append(prefix_ids + pool[:n])
        pool = pool[n:]
    kv = torch.zeros(2, num_blocks, block_size, NUM_KV_HEADS, HEAD, dtype=cache_dtype)
    shared_k = torch.randn(prefix_len, NUM_KV_HEADS, HEAD)
    shared_v = torch.randn(prefix_len, NUM_KV_HEADS, HEAD)
    full_k, full_v = [], []
    for s in seq_lens:
        full_k.append(torch.cat([shared_k, torch.randn(s - prefix_len, NUM_KV_HEADS, HEAD)]))
        full_v.append(torch.cat([shared_v, torch.randn(s - prefix_len, NUM_KV_HEADS, HEAD)]))
    for r, c in enumerate(computed):
        for pos in range(c):
            block, off = tables[r][pos // block_size], pos % block_size
            kv[0, block, off], kv[1, block, off] = full_k[r][pos], full_v[r][pos]
    return tables, kv, full_k, full_v, nbp


def _naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:
    """One decode query [H, hd] at the last of k/v's positions, in float64."""
    lo = 0 if window is None else max(0, k.shape[0] - window)
    group = q.shape[0] // k.shape[1]
    k = k[lo:].repeat_interleave(group, dim=1).double()
    v = v[lo:].repeat_interleave(group, dim=1).double()
    scores = torch.einsum("hd,shd->hs", q.double(), k) * HEAD**-0.5
    return torch.einsum("hs,shd->hd", scores.softmax(-1), v).float()


@pytest.mark.parametrize(
    ("cache_dtype", "window"),
    [
        (torch.float32, None),
        (torch.bfloat16, None),
        (torch.float16, 4096),  # a window that covers every key: still cascade
        (torch.float32, 300),  # a window inside the prefix: this layer attends row by row
    ],
)
def test_decode_rows_over_a_shared_prefix(cache_dtype: torch.dtype, window: int | None) -> None:
    """Twelve decode rows sharing a 1,536-token prefix (each with its own tail) and a
    prefill chunk in the same step: the cascade split gives each row's attention over
    its whole context, as the row-by-row paths do; this step's K/V land in the cache."""
    rng = random.Random(str(cache_dtype) + str(window))
    torch.manual_seed(len(str(cache_dtype)))
    block_size, prefix_len = 16, 1536
    decodes = 12
    query_lens = [1] * 5 + [7] + [1] * (decodes - 5)
    computed = [prefix_len + rng.randint(0, 40) for _ in query_lens]
    computed[5] = prefix_len + 3  # the prefill chunk also starts after the prefix
    tables, kv, full_k, full_v, nbp = _setup(
        rng, prefix_len, query_lens, computed, block_size, cache_dtype
    )
    common = make_common_attn_metadata(
        query_lens, computed, tables, block_size, num_common_prefix_blocks=nbp
    )
    # 12 rows: the cost rule leaves them to the C++ kernel, but not to the torch path.
    by_rule = CPUAttentionMetadataBuilder(block_size, "cpu").build(common).cascade
    assert (by_rule is None) == ops.available()
    with ops.disabled():
        assert CPUAttentionMetadataBuilder(block_size, "cpu").build(common).cascade is not None
    with forced():
        md = CPUAttentionMetadataBuilder(block_size, "cpu").build(common)
    assert md.cascade is not None and md.kernel_decode is None
    assert md.cascade.common_prefix_len == prefix_len
    plain = CPUAttentionMetadataBuilder(block_size, "cpu").build(
        make_common_attn_metadata(query_lens, computed, tables, block_size)
    )
    assert plain.cascade is None

    q = torch.randn(sum(query_lens), NUM_HEADS, HEAD)
    k = torch.cat([full_k[r][c:] for r, c in enumerate(computed)])
    v = torch.cat([full_v[r][c:] for r, c in enumerate(computed)])
    impl = CPUAttentionImpl(NUM_HEADS, HEAD, HEAD**-0.5, NUM_KV_HEADS, window)
    out = impl.forward(torch.nn.Module(), q, k, v, kv.clone(), md)
    with ops.disabled():
        out_torch = impl.forward(torch.nn.Module(), q, k, v, kv.clone(), md)
    written = kv.clone()
    out_plain = impl.forward(torch.nn.Module(), q, k, v, written, plain)

    # Compare against what the cache holds (a narrower type rounds the stored values).
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    for r, q_len in enumerate(query_lens):
        if q_len != 1:
            continue
        stored_k, stored_v = full_k[r].to(cache_dtype).float(), full_v[r].to(cache_dtype).float()
        expected = _naive(q[starts[r]], stored_k, stored_v, window)
        for result in (out, out_torch):
            torch.testing.assert_close(result[starts[r]], expected, atol=2e-5, rtol=1e-5)
    # Same for the prefill chunk and the row-by-row decode: cascade changes nothing else.
    torch.testing.assert_close(out, out_plain, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(out_torch, out_plain, atol=2e-5, rtol=1e-5)
    # Variants the split does not reproduce fall back to their row-by-row path.
    for variant in ({"attention_chunk_size": 512}, {"logits_soft_cap": 5.0}):
        other = CPUAttentionImpl(NUM_HEADS, HEAD, HEAD**-0.5, NUM_KV_HEADS, window, **variant)
        torch.testing.assert_close(
            other.forward(torch.nn.Module(), q, k, v, kv.clone(), md),
            other.forward(torch.nn.Module(), q, k, v, kv.clone(), plain),
        )


def test_builder_clamps_and_declines() -> None:
    """The builder trusts the scheduler's count only as far as the tables agree, leaves
    every row at least its newest key, and follows the cost rule."""
    rng = random.Random(1)
    block_size, prefix_len, rows = 16, 2048, 64
    query_lens, computed = [1] * rows, [prefix_len + 5 + 3 * r for r in range(rows)]
    tables, _, _, _, nbp = _setup(rng, prefix_len, query_lens, computed, block_size, torch.float32)
    builder = CPUAttentionMetadataBuilder(block_size, "cpu")

    def build(tables: list[list[int]], num_prefix_blocks: int, rows: int = rows) -> int | None:
        common = make_common_attn_metadata(
            query_lens[:rows], computed[:rows], tables[:rows], block_size, "cpu",
            num_prefix_blocks,
        )  # fmt: skip
        cascade = builder.build(common).cascade
        return None if cascade is None else cascade.common_prefix_len

    # The torch decode path's rule (against the C++ kernel cascade stays off).
    with ops.disabled():
        assert build(tables, nbp) == prefix_len
        assert build(tables, 0) is None
        # Every row holding the same next block as well (one request alone holds all its
        # blocks in common): the prefix stops before each row's newest token.
        same_next = [[*t[:nbp], tables[0][nbp], *t[nbp + 1 :]] for t in tables]
        assert build(same_next, nbp + 1) == prefix_len
        # A count the tables contradict (one row's first blocks differ): no cascade.
        swapped = [list(t) for t in tables]
        swapped[3][:2] = swapped[3][1::-1]
        assert build(swapped, nbp) is None
    # Fewer rows than the rule asks for.
    assert build(tables, nbp, rows=MIN_DECODE_ROWS - 1) is None
    assert build(tables, nbp) is None  # the C++ kernel serves these rows
    with ops.disabled():
        assert build(tables, nbp, rows=MIN_DECODE_ROWS) == prefix_len
    if ops.available():
        assert build(tables, nbp, rows=32) is None
    with forced():
        assert build(tables, nbp, rows=MIN_DECODE_ROWS - 1) == prefix_len


@pytest.mark.slow
def test_shared_prefix_batch_same_tokens_with_and_without_cascade(
    llm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """16 requests sharing a 408-token prefix (past MIN_COMMON_PREFIX_LEN, with twice
    MIN_DECODE_ROWS rows), each with its own question, greedy, 16 tokens: forced into the
    cascade path, every decode step takes it (recorded from the real builder) and the
    tokens equal those of the same batch attended row by row (the cost rule's choice for
    it) and HF's for the last request. The engine option that turns cascade off is
    compared in tests/benchmarks/test_cascade.py."""
    num_requests, prefix_len = 2 * MIN_DECODE_ROWS, MIN_COMMON_PREFIX_LEN + 152
    prompts = shared_prefix_prompts(llm.get_tokenizer(), num_requests, prefix_len)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    requests: list[Any] = [{"prompt_token_ids": p} for p in prompts]

    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner
    builder = runner.attn_builders[0]
    build = builder.build
    prefix_lens: list[int] = []

    def recording_build(common: Any) -> Any:
        md = build(common)
        prefix_lens.append(md.cascade.common_prefix_len if md.cascade is not None else 0)
        return md

    def generate() -> list[list[int]]:
        outputs = llm.generate(requests, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    monkeypatch.setattr(builder, "build", recording_build)
    with forced():
        on = generate()
    # 15 decode steps for 16 tokens, all of them over the prefix's whole blocks.
    block_size = builder.block_size
    assert prefix_lens.count(prefix_len // block_size * block_size) >= 15
    prefix_lens.clear()
    off = generate()
    # The cost rule leaves this batch to the C++ kernel, row by row.
    assert not any(prefix_lens) or not ops.available()
    monkeypatch.undo()
    assert on == off
    assert on[-1] == hf_reference().greedy(prompts[-1], 16)
    assert_no_leak(llm)


def test_disable_cascade_attn_flag_reaches_the_model_config() -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    on = EngineArgs.from_cli_args(parser.parse_args([])).create_engine_config()
    off = EngineArgs.from_cli_args(parser.parse_args(["--disable-cascade-attn"]))
    assert not on.model_config.disable_cascade_attn
    assert off.create_engine_config().model_config.disable_cascade_attn
