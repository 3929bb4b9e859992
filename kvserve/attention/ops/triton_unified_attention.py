"""Unified paged attention in Triton: one kernel for a step's prefill chunks and decodes.

Semantics are the CPU backend's (``attention.backends.utils.visible_keys``): the tokens
of request ``s`` are ``query_start_loc[s]:query_start_loc[s+1]`` of the flattened batch
and sit at the last ``q_len`` positions of its ``seq_lens[s]`` keys, which the cache
already holds (the step's K/V written first), read in place through the block table.

Work split (the shape of vLLM's unified kernel, written anew): a program owns one KV
head and ``BLOCK_Q`` consecutive query tokens of one request, i.e. ``BLOCK_M = BLOCK_Q *
G`` query rows (the ``G`` query heads sharing the KV head, so each K/V tile is loaded
once for the whole group, GQA/MQA's point). It walks the visible keys in tiles of
``TILE_N`` with an online softmax. Program ids are laid out so that request ``s`` owns
``[query_start_loc[s] // BLOCK_Q + s, query_start_loc[s+1] // BLOCK_Q + s + 1)``, a
range never shorter than its ``ceil(q_len / BLOCK_Q)`` query blocks; a program finds
its request by binary search and exits when its block is past the request's tokens. The
grid then depends on the token and request counts only, not on the lengths (what a CUDA
graph of fixed shape needs).

Visible keys of query position ``q``: ``k <= q`` (causal), ``k > q - sliding_window``
unless ``k < num_sink_tokens`` (StreamingLLM sinks), and ``k // C == q // C`` (chunked
local attention); a program's loop starts at the first tile any of its queries sees
(after a separate pass over the sink tiles), so a windowed layer reads only its window.
Scores are soft-capped (``cap * tanh(s / cap)``) before the mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvserve.attention.ops.triton_kernel import check_launchable

# Triton's tl.dot needs M, N and K of at least 16 on NVIDIA GPUs.
MIN_DOT = 16
# Split-KV: below this many (query block, KV head) programs a GPU has idle SMs (an H100
# has 132), so long contexts are cut into up to MAX_SPLITS parts of at least
# MIN_TILES_PER_SPLIT tiles each, merged by a second kernel.
SPLIT_BELOW_PROGRAMS = 128
MAX_SPLITS = 16
MIN_TILES_PER_SPLIT = 4


@dataclass(frozen=True)
class AttentionVariant:
    """One layer's attention rule; None/0 = off."""

    scale: float
    causal: bool = True
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    num_sink_tokens: int = 0
    logits_soft_cap: float | None = None


@triton.jit
def _unified_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    positions_ptr,
    num_seqs,
    scale,
    soft_cap,
    sliding_window,
    chunk_size,
    num_sink_tokens,
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    stride_bt,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    tiles_per_split,
    NUM_QUERIES_PER_KV: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SINKS: tl.constexpr,
    USE_CHUNK: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_POSITIONS: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)

    # The request owning this program: the last s with start(s) // BLOCK_Q + s <= q_block.
    lo = q_block * 0  # a tensor from the start: loop-carried values keep one type
    hi = lo + num_seqs
    while lo < hi - 1:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(first <= q_block, mid, lo)
        hi = tl.where(first <= q_block, hi, mid)
    seq = lo
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + seq)
    if local_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_tok = local_block * BLOCK_Q + rows // NUM_QUERIES_PER_KV  # index within the request
    head = kv_head * NUM_QUERIES_PER_KV + rows % NUM_QUERIES_PER_KV
    row_ok = (rows // NUM_QUERIES_PER_KV < BLOCK_Q) & (q_tok < q_len)
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_SIZE

    token = (q_start + q_tok).to(tl.int64)
    q_offs = token[:, None] * stride_q_t + head[:, None] * stride_q_h + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    # Positions: a request's last q_len, or given per token (ascending within a request:
    # CacheBlend's kept tokens).
    block_end = tl.minimum((local_block + 1) * BLOCK_Q, q_len) - 1
    if USE_POSITIONS:
        q_pos = tl.load(positions_ptr + token, mask=row_ok, other=0)
        first_pos = tl.load(positions_ptr + q_start + local_block * BLOCK_Q)
        last_pos = tl.load(positions_ptr + q_start + block_end)
    else:
        q_pos = context_len + q_tok
        first_pos = context_len + local_block * BLOCK_Q
        last_pos = context_len + block_end
    # Keys this block's queries may see: [key_start, key_end), plus the sinks.
    key_end = seq_len
    key_start = first_pos * 0
    if CAUSAL:
        key_end = last_pos + 1
        if USE_WINDOW:
            key_start = tl.maximum(key_start, first_pos - sliding_window + 1)
        if USE_CHUNK:
            key_start = tl.maximum(key_start, (first_pos // chunk_size) * chunk_size)
    tile_start = key_start // TILE_N
    num_sink_tiles = tile_start * 0
    if CAUSAL:  # nested constexpr ifs: no boolean operators on constexprs in the body
        if USE_WINDOW:
            if USE_SINKS:
                num_sink_tiles = tl.minimum((num_sink_tokens + TILE_N - 1) // TILE_N, tile_start)
    num_tiles = num_sink_tiles + (key_end + TILE_N - 1) // TILE_N - tile_start

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    keys = tl.arange(0, TILE_N)
    table_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    t_begin = num_tiles * 0
    if NUM_SPLITS > 1:
        # Split-KV: this program walks its split's share of the tiles only.
        split = tl.program_id(2)
        t_begin = split * tiles_per_split
        num_tiles = tl.minimum(num_tiles, t_begin + tiles_per_split)
    for t in range(t_begin, num_tiles):
        tile = tl.where(t < num_sink_tiles, t, tile_start + t - num_sink_tiles)
        k_pos = tile * TILE_N + keys
        k_ok = k_pos < key_end
        # Holes in the table (padding -1, null blocks) are only ever read under the mask.
        block = tl.load(table_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0)
        block = tl.maximum(block, 0).to(tl.int64)
        slot = k_pos % BLOCK_SIZE
        kv_ok = k_ok[None, :] & dim_ok[:, None]
        k_offs = block[None, :] * stride_k_block + slot[None, :] * stride_k_slot
        k = tl.load(
            k_cache_ptr + k_offs + kv_head * stride_k_head + dims[:, None], mask=kv_ok, other=0.0
        )  # [HEAD_PAD, TILE_N]
        v_offs = block[:, None] * stride_v_block + slot[:, None] * stride_v_slot
        v = tl.load(
            v_cache_ptr + v_offs + kv_head * stride_v_head + dims[None, :],
            mask=k_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )  # [TILE_N, HEAD_PAD]

        s = tl.dot(q, k.to(q.dtype), input_precision="ieee") * scale
        if USE_SOFTCAP:
            # tanh from exp (no tanh in tl's core): 1 - 2 / (e^{2x} + 1), exact at +-inf.
            s = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * s / soft_cap) + 1.0))
        visible = row_ok[:, None] & k_ok[None, :]
        if CAUSAL:
            visible = visible & (k_pos[None, :] <= q_pos[:, None])
            if USE_WINDOW:
                in_window = k_pos[None, :] > q_pos[:, None] - sliding_window
                if USE_SINKS:
                    in_window = in_window | (k_pos[None, :] < num_sink_tokens)
                visible = visible & in_window
            if USE_CHUNK:
                visible = visible & (k_pos[None, :] // chunk_size == q_pos[:, None] // chunk_size)
        s = tl.where(visible, s, float("-inf"))

        # Online softmax; a row that has seen no key yet keeps max -inf, shifted by 0.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision="ieee")
        m_i = m_new

    if NUM_SPLITS > 1:
        # Partial state (unnormalized sum, running max, exp-sum), merged by _merge_splits.
        part = (token * (NUM_QUERIES_PER_KV * tl.num_programs(1)) + head) * NUM_SPLITS + split
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)
        tl.store(
            part_out_ptr + part[:, None] * HEAD_PAD + dims[None, :],
            acc,
            mask=row_ok[:, None],
        )
        return
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_offs = token[:, None] * stride_o_t + head[:, None] * stride_o_h + dims[None, :]
    tl.store(
        out_ptr + o_offs,
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    stride_o_t,
    stride_o_h,
    num_heads,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """One (token, head): the splits' partial softmaxes rescaled to a common max and
    summed; a split that saw no key has max -inf and weighs 0."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    base = (token * num_heads + head) * NUM_SPLITS
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_PAD)
    m = tl.load(part_max_ptr + base + splits)
    l = tl.load(part_sum_ptr + base + splits)  # noqa: E741
    acc = tl.load(part_out_ptr + (base + splits)[:, None] * HEAD_PAD + dims[None, :])
    m_all = tl.max(m, axis=0)
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.exp(m - m_safe)
    total = tl.sum(w * l, axis=0)
    out = tl.sum(w[:, None] * acc, axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + token * stride_o_t + head * stride_o_h + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_SIZE,
    )


def launch_shape(num_queries_per_kv: int) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_M): at least MIN_DOT query rows, a whole number of GQA groups
    each; BLOCK_M is a power of two (Triton's block shapes), its tail rows idle."""
    block_m = max(MIN_DOT, triton.next_power_of_2(num_queries_per_kv))
    return block_m // num_queries_per_kv, block_m


def unified_attention(
    output: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_seqs: int,
    num_tokens: int,
    variant: AttentionVariant,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    positions: torch.Tensor | None = None,
) -> None:
    """Attention of ``query [T, num_heads, head_size]``'s first ``num_tokens`` rows over
    ``kv_cache [2, num_blocks, block_size, num_kv_heads, head_size]`` into ``output``
    (same shape as ``query``; rows past ``num_tokens`` untouched). ``block_table`` int32
    ``[>= num_seqs, max_blocks]``, ``seq_lens`` int32 ``[num_seqs]``, ``query_start_loc``
    int32 ``[num_seqs + 1]``, all on the query's device. ``num_splits`` (a power of
    two) cuts each program's keys into that many parts run in parallel; None chooses
    from ``max_seq_len`` (``choose_num_splits``). ``positions`` (int32 ``[num_tokens]``,
    ascending within a request) places each query; None: a request's last positions."""
    if num_tokens == 0 or num_seqs == 0:
        return
    num_heads, head_size = query.shape[1:]
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    if query.stride(-1) != 1 or output.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("unified_attention: the head dimension must be contiguous")
    block_q, block_m = launch_shape(group)
    head_pad = max(MIN_DOT, triton.next_power_of_2(head_size))
    # Tiles of whole cache blocks where they are big enough: one table read per tile.
    tile_n = max(MIN_DOT, min(64, triton.next_power_of_2(block_size)))
    v = variant
    num_q_blocks = num_tokens // block_q + num_seqs
    if num_splits is None:
        num_splits = choose_num_splits(
            query.device, num_q_blocks * num_kv_heads, max_seq_len, tile_n
        )
    if num_splits & (num_splits - 1) or num_splits < 1:
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    tiles_per_split = 0
    part_out = part_max = part_sum = output  # unused without splits
    if num_splits > 1:
        max_tiles = -(-(max_seq_len or int(seq_lens.max())) // tile_n)
        tiles_per_split = -(-max_tiles // num_splits)
        part_out = query.new_empty(
            (num_tokens, num_heads, num_splits, head_pad), dtype=torch.float32
        )
        part_max = query.new_empty((num_tokens, num_heads, num_splits), dtype=torch.float32)
        part_sum = torch.empty_like(part_max)
    grid = (num_q_blocks, num_kv_heads, num_splits)
    check_launchable(_unified_attention_kernel, query)
    _unified_attention_kernel[grid](
        output, query, k_cache, v_cache, block_table, seq_lens, query_start_loc,
        seq_lens if positions is None else positions,
        num_seqs,
        float(v.scale),
        float(v.logits_soft_cap or 1.0),
        int(v.sliding_window or 0),
        int(v.attention_chunk_size or 1),
        int(v.num_sink_tokens),
        query.stride(0), query.stride(1), output.stride(0), output.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
        part_out, part_max, part_sum, tiles_per_split,
        NUM_QUERIES_PER_KV=group,
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        TILE_N=tile_n,
        CAUSAL=v.causal,
        USE_WINDOW=v.sliding_window is not None,
        USE_SINKS=v.num_sink_tokens > 0,
        USE_CHUNK=v.attention_chunk_size is not None,
        USE_SOFTCAP=v.logits_soft_cap is not None,
        NUM_SPLITS=num_splits,
        USE_POSITIONS=positions is not None,
    )  # fmt: skip
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            output, part_out, part_max, part_sum, output.stride(0), output.stride(1), num_heads,
            HEAD_SIZE=head_size, HEAD_PAD=head_pad, NUM_SPLITS=num_splits,
        )  # fmt: skip


def choose_num_splits(
    device: torch.device, num_programs: int, max_seq_len: int | None, tile_n: int
) -> int:
    """Splits for a step: 1 unless on a GPU with fewer programs than SPLIT_BELOW_PROGRAMS
    and keys enough for two splits of MIN_TILES_PER_SPLIT tiles (long-context decodes of
    small batches), then the largest power of two that neither overfills the GPU nor
    goes below MIN_TILES_PER_SPLIT. Interpreted (CPU) runs never split: no SMs to fill."""
    if device.type != "cuda" or max_seq_len is None or num_programs >= SPLIT_BELOW_PROGRAMS:
        return 1
    tiles = -(-max_seq_len // tile_n)
    limit = min(MAX_SPLITS, tiles // MIN_TILES_PER_SPLIT, -(-SPLIT_BELOW_PROGRAMS // num_programs))
    splits = 1
    while splits * 2 <= limit:
        splits *= 2
    return splits
