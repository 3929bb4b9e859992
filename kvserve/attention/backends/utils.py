"""Backend-neutral per-step attention inputs, built by the model runner once per step."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CommonAttentionMetadata:
    """What every attention backend needs to know about one scheduled batch.

    Tokens of all requests are flattened in request order; request ``i`` owns tokens
    ``query_start_loc[i]:query_start_loc[i+1]``, which sit at absolute positions
    ``num_computed_tokens[i] .. seq_lens[i]-1`` of its sequence.
    """

    query_start_loc: torch.Tensor  # int32 [num_reqs+1], on device
    query_start_loc_cpu: torch.Tensor  # same, CPU
    seq_lens: torch.Tensor  # int32 [num_reqs]: context length after this step
    seq_lens_cpu: torch.Tensor
    num_computed_tokens_cpu: torch.Tensor  # int32 [num_reqs]
    num_reqs: int
    num_actual_tokens: int  # total scheduled tokens
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor  # int32 [num_reqs, max_num_blocks_per_req], device
    slot_mapping: torch.Tensor  # int64 [num_actual_tokens]: block_id*block_size+offset, -1 = skip
    # Leading blocks of the table shared by every request (the scheduler's count for this
    # group; 0 where its manager shares none): cascade attention's common prefix, vLLM's
    # common_prefix_len in blocks.
    num_common_prefix_blocks: int = 0

    @property
    def query_lens_cpu(self) -> torch.Tensor:
        return self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]


def slice_common_attn_metadata(
    common: CommonAttentionMetadata, request_slice: slice, token_slice: slice
) -> CommonAttentionMetadata:
    """The metadata of a run of whole requests and their tokens (a micro-batch of dual
    batch overlap, vLLM's UBatchSlice): views of the step's tensors, with the query
    start offsets rebased to the run's first token."""
    r0, r1 = request_slice.start, request_slice.stop
    t0, t1 = token_slice.start, token_slice.stop
    qsl_cpu = common.query_start_loc_cpu[r0 : r1 + 1]
    assert int(qsl_cpu[0]) == t0 and int(qsl_cpu[-1]) == t1, "slices must hold whole requests"
    seq_lens_cpu = common.seq_lens_cpu[r0:r1]
    query_lens = qsl_cpu[1:] - qsl_cpu[:-1]
    return CommonAttentionMetadata(
        query_start_loc=common.query_start_loc[r0 : r1 + 1] - t0,
        query_start_loc_cpu=qsl_cpu - t0,
        seq_lens=common.seq_lens[r0:r1],
        seq_lens_cpu=seq_lens_cpu,
        num_computed_tokens_cpu=common.num_computed_tokens_cpu[r0:r1],
        num_reqs=r1 - r0,
        num_actual_tokens=t1 - t0,
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens_cpu.max()),
        block_table_tensor=common.block_table_tensor[r0:r1],
        slot_mapping=common.slot_mapping[t0:t1],
        num_common_prefix_blocks=common.num_common_prefix_blocks,
    )


def write_to_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    token_indices: torch.Tensor | None = None,
) -> None:
    """Scatter this step's K/V ``[T, num_kv_heads, head_size]`` into the paged cache
    ``[2, num_blocks, block_size, num_kv_heads, head_size]``.

    ``token_indices`` selects the tokens whose slot is valid; the builder computes it
    once per step so the layers never do a data-dependent ``slot >= 0`` filter (a
    device sync on GPU) themselves. A narrower cache (--kv-cache-dtype) stores the values
    rounded to its type.
    """
    if token_indices is not None:
        key, value = key[token_indices], value[token_indices]
    key, value = key.to(kv_cache.dtype), value.to(kv_cache.dtype)
    num_kv_heads, head_size = kv_cache.shape[-2:]
    kv_cache[0].view(-1, num_kv_heads, head_size).index_copy_(0, slot_mapping, key)
    kv_cache[1].view(-1, num_kv_heads, head_size).index_copy_(0, slot_mapping, value)


def make_common_attn_metadata(
    query_lens: list[int],
    num_computed_tokens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
    num_common_prefix_blocks: int = 0,
) -> CommonAttentionMetadata:
    """Build metadata from plain lists (tests, tools, simple runners).

    Token ``j`` of request ``i`` sits at position ``num_computed_tokens[i] + j`` and is
    stored at slot ``block_tables[i][pos // block_size] * block_size + pos % block_size``.
    """
    num_reqs = len(query_lens)
    query_start_loc_cpu = torch.zeros(num_reqs + 1, dtype=torch.int32)
    query_start_loc_cpu[1:] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
    computed = torch.tensor(num_computed_tokens, dtype=torch.int32)
    seq_lens_cpu = computed + torch.tensor(query_lens, dtype=torch.int32)
    width = max((len(row) for row in block_tables), default=1)
    table = torch.zeros(num_reqs, width, dtype=torch.int32)
    for i, row in enumerate(block_tables):
        table[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
    slots: list[int] = []
    for i, q_len in enumerate(query_lens):
        for pos in range(num_computed_tokens[i], num_computed_tokens[i] + q_len):
            slots.append(block_tables[i][pos // block_size] * block_size + pos % block_size)
    return CommonAttentionMetadata(
        query_start_loc=query_start_loc_cpu.to(device),
        query_start_loc_cpu=query_start_loc_cpu,
        seq_lens=seq_lens_cpu.to(device),
        seq_lens_cpu=seq_lens_cpu,
        num_computed_tokens_cpu=computed,
        num_reqs=num_reqs,
        num_actual_tokens=sum(query_lens),
        max_query_len=max(query_lens, default=0),
        max_seq_len=int(seq_lens_cpu.max()) if num_reqs else 0,
        block_table_tensor=table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        num_common_prefix_blocks=num_common_prefix_blocks,
    )


def visible_keys(
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    sliding_window: int | None = None,
    attention_chunk_size: int | None = None,
    num_sink_tokens: int = 0,
) -> torch.Tensor:
    """The one visibility rule of every attention variant, prefill and decode alike:
    key position ``k`` is visible to query position ``q`` iff ``k <= q``, and ``k`` is
    in the window (``k > q - sliding_window``) or a sink (``k < num_sink_tokens``),
    and ``k`` is in ``q``'s chunk (``k // C == q // C``). Positions broadcast; True
    means "may attend". Keys outside the window may sit in the null block a
    sliding-window manager substitutes, so the mask is what keeps them out."""
    mask = key_pos <= query_pos
    if sliding_window is not None:
        in_window = key_pos > query_pos - sliding_window
        if num_sink_tokens:
            in_window = in_window | (key_pos < num_sink_tokens)
        mask = mask & in_window
    if attention_chunk_size is not None:
        mask = mask & (
            torch.div(key_pos, attention_chunk_size, rounding_mode="floor")
            == torch.div(query_pos, attention_chunk_size, rounding_mode="floor")
        )
    return mask
