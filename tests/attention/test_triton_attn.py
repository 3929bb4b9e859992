"""The Triton backend's kernels under Triton's interpreter (CPU tensors; the suite sets
TRITON_INTERPRET=1 on machines without a GPU, tests/conftest.py) against the CPU backend:
float32 outputs within 1e-5 and identical caches, on mixed prefill/decode batches with
ragged lengths, -1 padded block tables and null blocks, GQA ratios 1/3/8, several block
sizes and every attention variant. tests/attention/test_triton_attn_cuda.py runs the same
cases compiled on a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from kvserve.attention.backends.cpu_attn import CPUAttentionBackend
from kvserve.attention.backends.registry import get_attn_backend
from kvserve.attention.backends.triton_attn import TritonAttentionBackend
from kvserve.attention.backends.utils import make_common_attn_metadata
from kvserve.attention.ops.triton_kernel import check_launchable
from kvserve.attention.ops.triton_reshape_and_cache import reshape_and_cache
from kvserve.attention.ops.triton_unified_attention import choose_num_splits, unified_attention
from tests.attention.triton_cases import Case, run_case

if torch.cuda.is_available():
    pytest.skip(
        "CPU interpreter tests (the CUDA ones: test_triton_attn_cuda.py)", allow_module_level=True
    )

# decode, whole prefill, decode, chunked prefill, long decode, long chunked prefill.
QUERY_LENS = [1, 5, 1, 7, 1, 12]
COMPUTED = [6, 0, 13, 9, 40, 33]


# GQA ratios 1/3/8 and block sizes (5: not a power of two, 16: one per tile) in pairs:
# the interpreter runs every program in Python, so the full product would cost seconds.
@pytest.mark.parametrize(
    ("block_size", "num_heads", "num_kv_heads"),
    [(4, 2, 2), (5, 6, 2), (16, 8, 1), (4, 3, 1), (16, 2, 2)],
)
def test_mixed_batch_matches_cpu_backend(
    block_size: int, num_heads: int, num_kv_heads: int
) -> None:
    case = Case(num_heads=num_heads, num_kv_heads=num_kv_heads, block_size=block_size)
    run_case(case, QUERY_LENS, COMPUTED, seed=block_size * 10 + num_heads, device="cpu")


@pytest.mark.parametrize(
    "case",
    [
        Case(num_heads=6, num_kv_heads=2, window=8),
        Case(num_heads=6, num_kv_heads=2, window=8, sinks=4),
        Case(num_heads=6, num_kv_heads=2, window=8, sinks=20),  # sinks past the window
        Case(num_heads=6, num_kv_heads=2, chunk=16),
        Case(num_heads=6, num_kv_heads=2, soft_cap=5.0),
        Case(num_heads=6, num_kv_heads=2, window=8, soft_cap=20.0, block_size=16),
        Case(num_heads=8, num_kv_heads=1, chunk=12, block_size=5),
        Case(num_heads=4, num_kv_heads=2, head_size=12),  # head size padded to 16
        Case(num_heads=4, num_kv_heads=2, cache_dtype=torch.float16),
    ],
    ids=lambda c: "-".join(f"{k}={v}" for k, v in vars(c).items() if v != getattr(Case, k, None)),
)
def test_variants_match_cpu_backend(case: Case) -> None:
    run_case(case, QUERY_LENS, COMPUTED, seed=7, device="cpu")


def test_encoder_only_sees_whole_prompt() -> None:
    case = Case(num_heads=6, num_kv_heads=2, causal=False)
    run_case(case, [9, 1, 4], [0, 0, 0], seed=3, device="cpu")


def test_cache_write_touches_exactly_the_named_slots() -> None:
    torch.manual_seed(0)
    block_size, heads, head_size = 4, 3, 12
    kv_cache = torch.full((2, 6, block_size, heads, head_size), -7.0)
    kv = torch.randn(5, 2, heads, head_size)
    slots = torch.tensor([9, -1, 0, 23, 14])
    reshape_and_cache(kv[:, 0], kv[:, 1], kv_cache, slots)
    flat = kv_cache.view(2, -1, heads, head_size)
    expected = torch.full_like(flat, -7.0)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[0, slot], expected[1, slot] = kv[t, 0], kv[t, 1]
    assert torch.equal(flat, expected)
    # Only the first num_tokens tokens are written; a float16 cache stores rounded values.
    half = torch.zeros(2, 6, block_size, heads, head_size, dtype=torch.float16)
    reshape_and_cache(kv[:, 0], kv[:, 1], half, slots, num_tokens=1)
    assert torch.equal(half.view(2, -1, heads, head_size)[0, 9], kv[0, 0].half())
    assert int(half.count_nonzero()) == 2 * heads * head_size


def test_padding_rows_are_zero_and_not_cached() -> None:
    """A batch padded past its tokens (a captured batch size): the padding rows' output
    is zero and their K/V go nowhere, whatever their slot entries say."""
    torch.manual_seed(1)
    heads, kv_heads, head_size, bs = 4, 2, 16, 4
    common = make_common_attn_metadata([1, 3], [5, 0], [[1, 2], [3]], bs)
    common.slot_mapping = torch.cat([common.slot_mapping, torch.tensor([0, 0])])
    md = TritonAttentionBackend.get_builder_cls()(bs, "cpu").build(common)
    impl = TritonAttentionBackend.get_impl_cls()(heads, head_size, 0.25, kv_heads)
    kv_cache = torch.zeros(2, 4, bs, kv_heads, head_size)
    q, k = torch.randn(6, heads, head_size), torch.randn(6, kv_heads, head_size)
    out = impl.forward(torch.nn.Module(), q, k, k, kv_cache, md)
    assert out[4:].eq(0).all() and out[:4].ne(0).any()
    assert kv_cache[:, 0].eq(0).all()  # block 0 (the padding rows' slots) untouched


def test_registry_selects_triton() -> None:
    assert get_attn_backend("cpu", name="TRITON") is TritonAttentionBackend
    assert get_attn_backend("cuda") is TritonAttentionBackend
    assert get_attn_backend("cpu").get_name() == "CPU_ATTN"  # on a CPU only when forced


@pytest.mark.parametrize(
    "case",
    [
        Case(num_heads=6, num_kv_heads=2),
        Case(num_heads=6, num_kv_heads=2, window=8, sinks=4, soft_cap=5.0),
        Case(num_heads=8, num_kv_heads=1, chunk=12, block_size=5),
    ],
    ids=["plain", "window-sinks-softcap", "chunk"],
)
def test_split_kv_matches_one_pass(case: Case) -> None:
    """Split-KV (a GPU's choice for long contexts of small batches, forced here) gives the
    single pass's output: each split's partial softmax, merged, is the whole one. Splits
    past a short request's keys see nothing and must weigh nothing."""
    torch.manual_seed(5)
    bs = case.block_size
    query_lens, computed = [1, 1, 6, 1], [90, 3, 40, 60]
    tables, next_block = [], 1
    for c, n in zip(computed, query_lens, strict=True):
        count = -(-(c + n) // bs)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    common = make_common_attn_metadata(query_lens, computed, tables, bs)
    md = TritonAttentionBackend.get_builder_cls()(bs, "cpu").build(common)
    kv_cache = torch.randn(2, next_block, bs, case.num_kv_heads, case.head_size)
    query = torch.randn(sum(query_lens), case.num_heads, case.head_size)
    impl = TritonAttentionBackend.get_impl_cls()(
        case.num_heads, case.head_size, case.head_size**-0.5, case.num_kv_heads,
        case.window, case.chunk, case.soft_cap,
    )  # fmt: skip
    impl.num_sink_tokens = case.sinks
    outputs = []
    for splits in (1, 4):
        out = torch.zeros_like(query)
        unified_attention(
            out, query, kv_cache, md.block_table, md.seq_lens, md.query_start_loc,
            md.num_reqs, md.num_actual_tokens, impl.variant(), md.max_seq_len, splits,
        )  # fmt: skip
        outputs.append(out)
    assert outputs[0].abs().sum() > 0
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-5, rtol=1e-5)


def test_split_choice() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert choose_num_splits(cpu, 4, 100_000, 16) == 1  # interpreted: never
    assert choose_num_splits(cuda, 200, 100_000, 16) == 1  # the GPU is full already
    assert choose_num_splits(cuda, 8, 64, 16) == 1  # 4 tiles: one split's worth
    assert choose_num_splits(cuda, 8, 4096, 16) == 16
    assert choose_num_splits(cuda, 40, 4096, 16) == 4  # 4 x 40 programs fill 128


def test_cpu_launch_of_a_compiled_kernel_says_what_to_set() -> None:
    """A process that imported triton without TRITON_INTERPRET has compiled kernels only,
    which cannot touch CPU memory: the launch names the fix instead of crashing inside."""
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        check_launchable(object(), torch.zeros(1))


def test_kernels_compile_for_sm90(tmp_path: Path) -> None:
    """The compiled path, which the interpreter never takes, through Triton's compiler
    and ptxas for an H100, in a process without TRITON_INTERPRET."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-m", "tests.attention.triton_compile_check"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("sm_90 cubin") == 3, result.stdout


@pytest.mark.parametrize(
    "case",
    [Case(num_heads=6, num_kv_heads=2), Case(num_heads=6, num_kv_heads=2, window=6, sinks=2)],
    ids=["plain", "window-sinks"],
)
def test_selected_tokens_match_cpu_backend(case: Case) -> None:
    """CacheBlend goes on with some tokens of a step only (select_tokens): the kept
    queries sit at scattered positions of their requests, attend to the cache up to
    them, and only their K/V are written."""
    torch.manual_seed(9)
    bs = case.block_size
    query_lens, computed = [1, 14, 1, 9], [11, 0, 5, 20]
    tables, next_block = [], 1
    for c, n in zip(computed, query_lens, strict=True):
        count = -(-(c + n) // bs)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    # Every decode and every prefill's last token stay (CacheBlend's rule), plus a few.
    keep = torch.tensor([0, 1, 4, 5, 9, 14, 15, 16, 19, 20, 24])
    common = make_common_attn_metadata(query_lens, computed, tables, bs)
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, case.num_heads, case.head_size)
    kv = torch.randn(num_tokens, 2, case.num_kv_heads, case.head_size)
    kv_cache = torch.randn(2, next_block, bs, case.num_kv_heads, case.head_size)
    results = []
    for backend in (CPUAttentionBackend, TritonAttentionBackend):
        impl = backend.get_impl_cls()(
            case.num_heads, case.head_size, case.head_size**-0.5, case.num_kv_heads,
            case.window, case.chunk, case.soft_cap,
        )  # fmt: skip
        impl.num_sink_tokens = case.sinks
        md = backend.get_builder_cls()(bs, "cpu").build(common).select_tokens(keep)
        cache = kv_cache.clone()
        out = impl.forward(torch.nn.Module(), query[keep], kv[keep, 0], kv[keep, 1], cache, md)
        results.append((out, cache))
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-5, rtol=1e-5)
    assert torch.equal(results[1][1], results[0][1])
