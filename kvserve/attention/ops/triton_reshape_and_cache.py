"""The KV write of a step: each new token's K/V into the paged cache at its slot.

The cache is the backends' common layout ``[2, num_blocks, block_size, num_kv_heads,
head_size]``; slot ``s`` is ``block s // block_size``, offset ``s % block_size``. A slot
of -1 (a token whose K/V is not kept, e.g. one a KV connector loads) is skipped in the
kernel, so the caller never filters on the host (a device sync per step on CUDA).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.attention.ops.triton_kernel import check_launchable


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_SIZE)
    src = token.to(tl.int64) * stride_key_t + heads[:, None] * stride_key_h + dims[None, :]
    k = tl.load(key_ptr + src, mask=mask)
    src = token.to(tl.int64) * stride_value_t + heads[:, None] * stride_value_h + dims[None, :]
    v = tl.load(value_ptr + src, mask=mask)
    dst = block * stride_k_block + offset * stride_k_slot + heads[:, None] * stride_k_head
    tl.store(k_cache_ptr + dst + dims[None, :], k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    dst = block * stride_v_block + offset * stride_v_slot + heads[:, None] * stride_v_head
    tl.store(v_cache_ptr + dst + dims[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_tokens: int | None = None,
) -> None:
    """Write ``key``/``value`` ``[T, num_kv_heads, head_size]`` (rows may be strided
    views of a fused QKV output; the head dim must be contiguous) of the first
    ``num_tokens`` tokens into ``kv_cache`` at ``slot_mapping`` (int, -1 = skip). A
    narrower cache stores the values rounded to its type."""
    n = key.shape[0] if num_tokens is None else num_tokens
    if n == 0:
        return
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("reshape_and_cache: key/value need a contiguous head dimension")
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    num_kv_heads, head_size = k_cache.shape[-2:]
    if k_cache.stride(-1) != 1:
        raise ValueError("reshape_and_cache: the cache needs a contiguous head dimension")
    check_launchable(_reshape_and_cache_kernel, key)
    _reshape_and_cache_kernel[(n,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_PAD=triton.next_power_of_2(head_size),
        BLOCK_SIZE=k_cache.shape[1],
    )  # fmt: skip
