"""Cascade attention: decode rows that share a long common prefix (vLLM's cascade).

When every running request starts with the same KV blocks (the scheduler's
``num_common_prefix_blocks``, carried in ``CommonAttentionMetadata``), the decode rows'
attention splits at the end of that prefix:

* prefix: the D decode queries against the shared prefix keys in one batched attention,
  the D*G query heads of each KV head as its rows, so the prefix K/V are read once per
  step instead of once per request (and as one matrix product instead of D vector ones);
* suffix: each request's own keys after the prefix (its tail and this step's token), a
  padded batch with a length mask.

Each part returns its output and the log-sum-exp of its scores; ``merge_attn_states``
combines the two into what one softmax over the concatenated keys gives.

The fused decode stack (llama_decode_stack) has no cascade: a step that uses it hands
the stack no ``kernel_decode``, so the stack declines and the layers run one by one.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvserve import _custom_ops as ops

if TYPE_CHECKING:
    from kvserve.attention.backends.abstract import AttentionImpl
    from kvserve.attention.backends.cpu_attn import CPUAttentionImpl, DecodeBatch
    from kvserve.attention.backends.utils import CommonAttentionMetadata

# The cost rule's thresholds (see use_cascade_attention).
MIN_COMMON_PREFIX_LEN = 256
MIN_DECODE_ROWS = 8
# Prefix keys the decode rows read in all (rows x prefix tokens) from which cascade beats
# the C++ decode kernel; None: it never did at the default thread count, so it stays off.
MIN_PREFIX_READS_VS_KERNEL: int | None = None
_forced = threading.local()


def use_cascade_attention(
    common_prefix_len: int, num_decodes: int, vs_decode_kernel: bool = True
) -> bool:
    """The cost rule: cascade when the shared prefix is long and shared by many rows.

    As vLLM's ``use_cascade_attention``, a prefix under 256 tokens or fewer than 8
    decode rows never pays; that is the whole rule where the rows would otherwise take
    the torch decode path (CUDA tensors, no C++ kernels), which gathers every row's
    whole context per layer: 8 rows of 256 shared tokens already run 1.6x faster split,
    32 rows of 992 28x (one layer of SmolLM2-135M).

    Against the C++ decode kernel (``vs_decode_kernel``) the bar is far higher: the
    kernel reads a physically shared prefix from the CPU caches for every row after the
    first, so cascade wins only FLOP efficiency (one matrix product instead of D vector
    ones) and must pay back the suffix pass, the merge and the fused decode stack it
    turns off (the layers run one by one). There ``num_decodes * common_prefix_len``
    would have to reach MIN_PREFIX_READS_VS_KERNEL keys. None were found at the default
    two threads: 64 rows of 2,048 tokens ran 1.10x with one thread but 0.67x with two, 32
    rows of 1,000 0.88x and 0.63x (AMD EPYC Zen 5, 2 vCPU, loaded: docs/benchmarks.md),
    so against the kernel cascade is off. Inside ``forced()`` any whole-block prefix
    qualifies.
    """
    if getattr(_forced, "on", False):
        return common_prefix_len > 0 and num_decodes > 0
    return (
        common_prefix_len >= MIN_COMMON_PREFIX_LEN
        and num_decodes >= MIN_DECODE_ROWS
        and (
            not vs_decode_kernel
            or (
                MIN_PREFIX_READS_VS_KERNEL is not None
                and num_decodes * common_prefix_len >= MIN_PREFIX_READS_VS_KERNEL
            )
        )
    )


@contextmanager
def forced() -> Iterator[None]:
    """Cascade wherever a shared prefix allows, whatever the cost rule says, in this
    thread (an in-process engine steps in its caller's thread): tests and
    `kvserve bench cascade` run the path on batches the rule declines."""
    before = getattr(_forced, "on", False)
    _forced.on = True
    try:
        yield
    finally:
        _forced.on = before


@dataclass
class CascadeMetadata:
    """One step's split of its decode rows at the shared prefix, built once per step."""

    common_prefix_len: int  # tokens (whole blocks), vLLM's name
    prefix_block_ids: torch.Tensor  # int64 [P / block_size]
    suffix_block_ids: torch.Tensor  # int64 [D * suffix blocks]: each row's, row-major
    suffix_mask: torch.Tensor  # float32 [D, 1, 1, suffix blocks * block_size]: 0 or -inf
    max_seq_len: int  # longest decode row: a sliding window must cover it


def build_cascade_metadata(
    common: CommonAttentionMetadata, decode: DecodeBatch | None, block_size: int
) -> CascadeMetadata | None:
    """The split for this step's decode rows, or None where the cost rule says no."""
    num_prefix_blocks = common.num_common_prefix_blocks
    if decode is None or num_prefix_blocks <= 0:
        return None
    # The rule at its most generous (every decode row, the whole common prefix, no kernel
    # to beat): a single stream's step, whose one request is its own common prefix, ends
    # here without the tensor work below (0.15 ms of a 11 ms step, AMD EPYC Zen 3).
    if not use_cascade_attention(
        num_prefix_blocks * block_size, decode.token_indices.numel(), vs_decode_kernel=False
    ):
        return None
    # The layers compute in float32 (the model runner's dtype), as this probe does.
    kernel = ops.use_for(decode.block_table_i32.new_empty(0, dtype=torch.float32))
    # Decode rows are the requests with one query token, in request order (as DecodeBatch).
    is_decode = common.query_lens_cpu[: common.num_reqs] == 1
    seq_lens = common.seq_lens_cpu[: common.num_reqs][is_decode]
    # Every row keeps at least its newest key in the suffix (the scheduler counts whole
    # blocks held by all requests, which may run past a short request's tokens).
    num_prefix_blocks = min(num_prefix_blocks, (int(seq_lens.min()) - 1) // block_size)
    prefix_len = num_prefix_blocks * block_size
    table = decode.block_table_i32
    if not use_cascade_attention(prefix_len, len(seq_lens), kernel):
        return None
    prefix_ids = table[0, :num_prefix_blocks]
    if not bool((table[:, :num_prefix_blocks] == prefix_ids).all()):
        return None  # not one physical prefix after all: attend request by request
    suffix_table = table[:, num_prefix_blocks:].long()
    key_pos = torch.arange(suffix_table.shape[1] * block_size, device=table.device)
    visible = key_pos[None, :] < (decode.seq_lens - prefix_len)[:, None]
    mask = torch.zeros(visible.shape, dtype=torch.float32, device=table.device)
    mask.masked_fill_(~visible, float("-inf"))
    return CascadeMetadata(
        common_prefix_len=prefix_len,
        prefix_block_ids=prefix_ids.long(),
        suffix_block_ids=suffix_table.flatten(),
        suffix_mask=mask[:, None, None, :],
        max_seq_len=int(seq_lens.max()),
    )


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
    fused: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [B, H, Lq, hd]``, ``k/v [B, H, Lk, hd]``, additive ``mask`` broadcastable to
    ``[B, H, Lq, Lk]`` -> (output ``[B, H, Lq, hd]``, log-sum-exp of the scaled, masked
    scores ``[B, H, Lq]``). ``fused`` (default: on CPU tensors) runs torch's flash
    attention CPU kernel, which returns the log-sum-exp; otherwise plain matmuls."""
    if fused is None:
        fused = q.is_cpu
    if fused:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, attn_mask=mask, scale=scale
        )
        return out, lse
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores + mask
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]), v), lse


def merge_attn_states(
    out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor, lse2: torch.Tensor
) -> torch.Tensor:
    """Two attentions of the same queries over disjoint key sets -> the attention over
    their union: ``(e^{lse1-m} out1 + e^{lse2-m} out2) / (e^{lse1-m} + e^{lse2-m})``
    with ``m = max(lse1, lse2)``. ``out [..., hd]``, ``lse [...]``; each key set must be
    non-empty (a finite lse) for every query."""
    m = torch.maximum(lse1, lse2)
    w1 = torch.exp(lse1 - m).unsqueeze(-1)
    w2 = torch.exp(lse2 - m).unsqueeze(-1)
    return (out1 * w1 + out2 * w2) / (w1 + w2)


def serves_layer(impl: AttentionImpl, cascade: CascadeMetadata) -> bool:
    """Whether the split reproduces this layer's attention: no window shorter than the
    decode rows (a window covering every key is plain attention), no variant mask."""
    window = impl.sliding_window
    if window is not None and window < cascade.max_seq_len:
        return False
    # Chunked-local masks, sinks and soft-capped scores: not reproduced by the split.
    return (
        impl.attention_chunk_size is None
        and impl.num_sink_tokens == 0
        and impl.logits_soft_cap is None
    )


def cascade_decode(
    impl: CPUAttentionImpl,
    output: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    decode: DecodeBatch,
    cascade: CascadeMetadata,
) -> None:
    """Write the decode rows' attention into ``output``; the step's K/V are in the
    cache already. A layer the split does not serve attends row by row as without
    cascade (the C++ kernel, writing no slots, or the torch fallback)."""
    token_indices = decode.token_indices
    if not serves_layer(impl, cascade):
        if impl.kernel_supported and ops.use_for(query):
            no_slots = torch.zeros(0, dtype=torch.long, device=query.device)
            ops.cache_and_decode_attention(
                output, query, key, value, kv_cache, no_slots, decode.block_table_i32,
                decode.seq_lens_i32, token_indices, impl.scale, impl.sliding_window,
            )  # fmt: skip
        else:
            output[token_indices] = impl._decode(query, kv_cache[0], kv_cache[1], decode)
        return
    num_decodes = token_indices.shape[0]
    hkv, hd = impl.num_kv_heads, impl.head_size
    group = impl.num_heads // hkv
    q = query[token_indices].view(num_decodes, hkv, group, hd)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    # index_select, not k_cache[ids]: several times faster for whole-block gathers.

    # Prefix: [1, Hkv, D*G, hd] queries against [1, Hkv, P, hd] keys; a float16/bfloat16
    # cache is widened to the query's type, as the other paths do.
    q_prefix = q.permute(1, 0, 2, 3).reshape(1, hkv, num_decodes * group, hd)
    prefix_ids = cascade.prefix_block_ids
    k_prefix = k_cache.index_select(0, prefix_ids).view(-1, hkv, hd).transpose(0, 1)[None]
    v_prefix = v_cache.index_select(0, prefix_ids).view(-1, hkv, hd).transpose(0, 1)[None]
    out1, lse1 = attention_with_lse(
        q_prefix, k_prefix.to(q.dtype), v_prefix.to(q.dtype), impl.scale
    )
    out1 = out1.reshape(hkv, num_decodes, group, hd).transpose(0, 1)
    lse1 = lse1.reshape(hkv, num_decodes, group).transpose(0, 1)

    # Suffix: [D, Hkv, G, hd] queries against each row's own [D, Hkv, S, hd] keys.
    suffix_ids = cascade.suffix_block_ids
    k_suffix = k_cache.index_select(0, suffix_ids).view(num_decodes, -1, hkv, hd).transpose(1, 2)
    v_suffix = v_cache.index_select(0, suffix_ids).view(num_decodes, -1, hkv, hd).transpose(1, 2)
    out2, lse2 = attention_with_lse(
        q,
        k_suffix.to(q.dtype),
        v_suffix.to(q.dtype),
        impl.scale,
        cascade.suffix_mask.to(q.dtype),
    )
    merged = merge_attn_states(out1, lse1, out2, lse2)
    output[token_indices] = merged.reshape(num_decodes, impl.num_heads, hd)
