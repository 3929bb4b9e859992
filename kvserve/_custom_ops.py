"""The C++ CPU kernels (kvserve/csrc/), compiled on first use.

They are built just in time with torch's cpp_extension for the machine they run on
(``-march=native``), cached under the user's torch extensions directory, and registered
as ``torch.ops.kvserve.*``. Where no compiler is available, with
``KVSERVE_DISABLE_CUSTOM_OPS=1``, or where the build fails, ``available()`` is False and
callers use their plain torch paths, which compute the same thing; ``why_unavailable()``
tells the three apart (a failed build carries the compiler's output), so tests skip only
for the first two. How the library is built and found again: kernel_build.py.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kvserve.kernel_build import ENV_DISABLE, SOURCES, Unavailable, load

_lock = threading.Lock()
_state: dict[str, bool] = {}
_why: Unavailable | None = None  # set with _state["ok"]
_exact_kinds: frozenset[int] | None = None  # exact_packed_kinds()
_forced_off = threading.local()


def available() -> bool:
    """Whether torch.ops.kvserve's CPU kernels are loaded (builds them on the first call)."""
    global _why
    if "ok" in _state:
        return _state["ok"]
    with _lock:
        if "ok" not in _state:
            _why = load(SOURCES)
            _state["ok"] = _why is None
    return _state["ok"]


def why_unavailable() -> Unavailable | None:
    """Why ``available()`` is False; None where the kernels are loaded."""
    available()
    return _why


def use_for(tensor: torch.Tensor) -> bool:
    """Kernels apply to float32 CPU tensors when they are built."""
    # Asked several times per layer and step: the cheapest checks come first.
    if tensor.dtype != torch.float32 or not tensor.is_cpu or getattr(_forced_off, "on", False):
        return False
    ok = _state.get("ok")
    return available() if ok is None else ok


@contextmanager
def disabled() -> Iterator[None]:
    """Take the plain torch paths in this thread even where the kernels are built, so
    tests and benchmarks can compare the two."""
    before = getattr(_forced_off, "on", False)
    _forced_off.on = True
    try:
        yield
    finally:
        _forced_off.on = before


def cache_and_decode_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    token_indices: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> None:
    """Write ``key``/``value`` rows into the paged ``kv_cache`` at ``slot_mapping`` (-1 =
    skip), then decode attention for the ``token_indices`` rows (none when empty)."""
    torch.ops.kvserve.cache_and_decode_attention(
        out, query, key, value, kv_cache, slot_mapping, block_table, seq_lens, token_indices,
        scale, sliding_window or 0,
    )  # fmt: skip


def cache_and_decode_attention_int8(
    out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    token_indices: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> None:
    """``cache_and_decode_attention`` over an int8 cache (attention/backends/kv_cache_codec.py's
    layout): ``key``/``value`` rows quantized in, decode rows read dequantized."""
    torch.ops.kvserve.cache_and_decode_attention_int8(
        out, query, key, value, kv_cache, slot_mapping, block_table, seq_lens, token_indices,
        scale, sliding_window or 0,
    )  # fmt: skip


def decode_attention_partitions(context: int) -> int:
    """Context partitions that the decode attention kernel's split-K cuts a request's
    ``context`` tokens (after its sliding window) into (1: no split). They depend on the
    request's own context only, not on its batch or the thread count, so its attention
    rounds the same way in any batch and on any number of threads."""
    return int(torch.ops.kvserve.decode_attention_partitions(context))


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
) -> None:
    torch.ops.kvserve.rotary_embedding(positions, query, key, head_size, cos_sin_cache)


def rms_norm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    torch.ops.kvserve.rms_norm(out, x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    torch.ops.kvserve.fused_add_rms_norm(x, residual, weight, eps)


def silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    torch.ops.kvserve.silu_and_mul(out, x)


def gelu_tanh_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    torch.ops.kvserve.gelu_tanh_and_mul(out, x)


def require() -> None:
    """For features that exist only as kernels (block-quantized linear layers)."""
    if not available():
        raise RuntimeError(
            "this feature needs kvserve's C++ CPU kernels, which could not be built "
            f"(a C++ compiler and torch's headers are needed; ${ENV_DISABLE} must be unset)"
        )


def dequantize_blocks(
    qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor, kind: int
) -> torch.Tensor:
    require()
    return torch.ops.kvserve.dequantize_blocks(qs, d, m, kind)


def dequantize_rows(
    qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor, kind: int, ids: torch.Tensor
) -> torch.Tensor:
    """Rows ``ids`` (any shape of integers) of a block weight, ``[*ids.shape, cols]``
    float32, each bit for bit the row of ``dequantize_blocks``."""
    return torch.ops.kvserve.dequantize_rows(qs, d, m, kind, ids)


def block_linear(
    x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor, kind: int
) -> torch.Tensor:
    return torch.ops.kvserve.block_linear(x, qs, d, m, kind)


def exact_packed_matmul() -> bool:
    """Whether this build has the lossless digit matmul on interleaved blocks for any kind
    (AVX-512 VNNI or AVX2), for the weights BlockWeight.use_interleaved reorders."""
    return bool(exact_packed_kinds())


def exact_packed_kinds() -> frozenset[int]:
    """The interleaved block kinds this build's digit matmul runs: all of them (7-14) on
    AVX-512 VNNI, those with 4-bit quants (8-10, 13) on AVX2, none elsewhere."""
    global _exact_kinds
    if _exact_kinds is None:
        require()
        _exact_kinds = frozenset(torch.ops.kvserve.exact_packed_kinds())
    return _exact_kinds


def digit_matmul_rows() -> int:
    """Up to how many rows of x the digit matmul multiplies the interleaved kinds (and a
    row's result is the same whatever rows beside it): all of them on AVX-512 VNNI (until
    block_linear's dense path), one on AVX2, whose several rows take a float32 path on the
    same blocks (a row's result then the same in every call of two or more rows)."""
    require()
    return int(torch.ops.kvserve.digit_matmul_rows())


def dense_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` for float32 CPU tensors: the GEMM of long inputs (csrc/block_gemm.cpp)."""
    return torch.ops.kvserve.dense_linear(x, w)


def block_linear_int8(
    x: torch.Tensor,
    qs: torch.Tensor,
    d: torch.Tensor,
    m: torch.Tensor,
    kind: int,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    return torch.ops.kvserve.block_linear_int8(x, qs, d, m, kind, packed)


def greedy_screen(
    x: torch.Tensor,
    weight: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    kind: int,
    row_coeffs: torch.Tensor,
    block_coeffs: torch.Tensor,
    vocab: int,
    max_candidates: int,
) -> torch.Tensor:
    """int64 [R]: each row's greedy token over the weight's first ``vocab`` rows, -1 where
    the screen cannot tell (model_executor/layers/greedy_screen.py)."""
    qs, d, m = weight
    return torch.ops.kvserve.greedy_screen(
        x, qs, d, m, kind, row_coeffs, block_coeffs, vocab, max_candidates
    )


def greedy_screen_coeffs(
    weight: tuple[torch.Tensor, torch.Tensor, torch.Tensor], kind: int, vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy screen's bound coefficients: float32 [vocab, nb] and their row sums."""
    qs, d, m = weight
    blocks, rows = torch.ops.kvserve.greedy_screen_coeffs(qs, d, m, kind, vocab)
    return blocks, rows


def greedy_screen_approx(
    x: torch.Tensor, weight: tuple[torch.Tensor, torch.Tensor, torch.Tensor], kind: int
) -> torch.Tensor:
    """The greedy screen's approximate logits [R, N] (gguf_int8's arithmetic)."""
    qs, d, m = weight
    return torch.ops.kvserve.greedy_screen_approx(x.contiguous(), qs, d, m, kind)


def pack_blocks_vnni(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor, kind: int) -> torch.Tensor:
    """gguf_int8's row-interleaved copy of a block weight (for AVX-512 VNNI's kernel or
    AVX2's); empty in builds without either."""
    return torch.ops.kvserve.pack_blocks_vnni(qs, d, m, kind)


def nibble_planes(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor, kind: int) -> torch.Tensor:
    """Q4_1 / Q4_0 quants (kind 1 / 2) reordered into nibble planes (kind 5 / 6,
    csrc/block_gemm_planes.h), same shape; rows must hold a multiple of 64 weights."""
    return torch.ops.kvserve.nibble_planes(qs, d, m, kind)


def gemv_prefers_nibble_planes() -> bool:
    """Whether this build's float GEMV is faster on nibble planes (AVX2 without AVX-512)."""
    if "planes" not in _state:
        require()
        _state["planes"] = bool(torch.ops.kvserve.gemv_prefers_nibble_planes())
    return _state["planes"]


def integer_gemv_is_cheaper() -> bool:
    """Whether this build's gguf_int8 GEMV costs less than its exact float one on one row
    (AVX2 without AVX-512: the float one is bound by its arithmetic)."""
    if "integer_cheaper" not in _state:
        require()
        _state["integer_cheaper"] = bool(torch.ops.kvserve.integer_gemv_is_cheaper())
    return _state["integer_cheaper"]


def block_linear_dense_rows() -> int:
    """Rows of x from which block_linear dequantizes W for the dense GEMM; fewer take the
    GEMV, where a row's result never depends on the other rows (64; AVX2 builds: 128)."""
    require()
    return int(torch.ops.kvserve.block_linear_dense_rows())


def packs_int8_weights() -> bool:
    """Whether this build makes gguf_int8's interleaved copy (AVX-512 VNNI or AVX2), with
    which every matmul, batches included, runs on int8 activations."""
    if "packs" not in _state:
        require()
        planes = torch.zeros(1, 32, dtype=torch.int8), torch.zeros(1, 1, dtype=torch.float16)
        empty = torch.zeros(0, dtype=torch.float16)
        _state["packs"] = pack_blocks_vnni(*planes, empty, 0).numel() > 0
    return _state["packs"]


def memory_read_rates(
    nbytes: int, max_threads: int, repeats: int = 3, huge_pages: bool = False
) -> list[float]:
    """Best-of-``repeats`` GB/s at which 1..``max_threads`` threads together stream an
    ``nbytes`` buffer (csrc/memory_probe.cpp), on transparent huge pages if ``huge_pages``;
    index i holds i + 1 threads' rate."""
    require()
    return list(torch.ops.kvserve.memory_read_rates(nbytes, max_threads, repeats, huge_pages))


def decoder_stack(
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    eps: float,
    scale: float,
    cos_sin_cache: torch.Tensor,
) -> torch.ScriptObject:
    """An empty ``torch.classes.kvserve.DecoderStack`` (csrc/decode_stack.cpp); its
    ``add_layer`` is called once per decoder layer."""
    require()
    return torch.classes.kvserve.DecoderStack(
        num_heads, num_kv_heads, head_size, eps, scale, cos_sin_cache
    )


def mamba_decode_step(
    y: torch.Tensor,
    xbc: torch.Tensor,
    dt: torch.Tensor,
    pages: torch.Tensor,
    read_blocks: torch.Tensor,
    write_blocks: torch.Tensor,
    has_initial_state: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    dt_bias: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    time_step_limit: tuple[float, float],
    n_groups: int,
    state_size: int,
) -> None:
    """One token of each of R Mamba-2 requests (csrc/mamba_decode.cpp): conv1d + SiLU and
    the SSM recurrence with the D skip into ``y [R, H*P]``, each state read from its
    ``read_blocks`` entry of ``pages`` (zeros where ``has_initial_state`` is false) and
    the new state written to its ``write_blocks`` entry."""
    torch.ops.kvserve.mamba_decode_step(
        y, xbc, dt, pages, read_blocks, write_blocks, has_initial_state, conv_weight,
        conv_bias, dt_bias, A, D, time_step_limit[0], time_step_limit[1], n_groups, state_size,
    )  # fmt: skip


def shm_all_reduce(
    name: str, create: bool, rank: int, world: int, slot_bytes: int, timeout_s: float
) -> torch.ScriptObject:
    """A ``torch.classes.kvserve.ShmAllReduce`` (csrc/shm_all_reduce.cpp) over the POSIX
    shared-memory segment ``name``, made here when ``create``, opened otherwise; its
    ``all_reduce(tensor)`` sums in place over the ``world`` ranks mapping it."""
    require()
    return torch.classes.kvserve.ShmAllReduce(name, create, rank, world, slot_bytes, timeout_s)
