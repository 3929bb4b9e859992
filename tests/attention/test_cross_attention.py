"""CrossAttention over the paged cache: a request's first step writes the encoder K/V
into its cross-attention blocks and attends to them; later steps (decodes and prefill
chunks alike) read them back without K/V given; two requests holding the same blocks
read the same encoder output. Every result equals non-causal SDPA over the encoder
K/V directly."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.attention.backends.cross_attn import CrossAttentionMetadataBuilder
from kvserve.attention.backends.utils import CommonAttentionMetadata
from kvserve.attention.cross_attention import CrossAttention
from kvserve.forward_context import set_forward_context

HEADS, HEAD_SIZE, ENCODER_LEN, BLOCK = 2, 8, 10, 4


def _common(
    query_lens: list[int], num_computed: list[int], tables: list[list[int]]
) -> CommonAttentionMetadata:
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(
        [c + q for c, q in zip(num_computed, query_lens, strict=True)], dtype=torch.int32
    )
    width = max(len(t) for t in tables)
    table = torch.full((len(tables), width), -1, dtype=torch.int32)
    for row, ids in enumerate(tables):
        table[row, : len(ids)] = torch.tensor(ids)
    return CommonAttentionMetadata(
        query_start_loc=starts,
        query_start_loc_cpu=starts,
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens,
        num_computed_tokens_cpu=torch.tensor(num_computed, dtype=torch.int32),
        num_reqs=len(tables),
        num_actual_tokens=sum(query_lens),
        max_query_len=max(query_lens),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=table,
        slot_mapping=torch.full((sum(query_lens),), -1, dtype=torch.int64),
    )


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``q [Lq, H, hd]`` over ``k/v [ENCODER_LEN, H, hd]``, no mask, scale 1/sqrt(hd)."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
    return out.transpose(0, 1).reshape(q.shape[0], -1)


def test_write_once_then_read_decode_prefill_and_shared_blocks() -> None:
    torch.manual_seed(0)
    layer = CrossAttention(HEADS, HEAD_SIZE, HEAD_SIZE**-0.5, HEADS, "cross.0", ENCODER_LEN)
    layer.kv_cache = torch.zeros(2, 10, BLOCK, HEADS, HEAD_SIZE)
    builder = CrossAttentionMetadataBuilder(BLOCK, "cpu")
    audio = [torch.randn(2, ENCODER_LEN, HEADS, HEAD_SIZE) for _ in range(2)]  # (k, v) each
    tables = [[3, 7, 1], [2, 9, 5]]

    def run(
        query_lens: list[int], computed: list[int], rows: list[list[int]], kv: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        md = builder.build(_common(query_lens, computed, rows))
        q = torch.randn(sum(query_lens), HEADS * HEAD_SIZE)
        k = torch.cat([audio[i][0] for i in kv]).flatten(1) if kv else None
        v = torch.cat([audio[i][1] for i in kv]).flatten(1) if kv else None
        with set_forward_context(md):
            return q, layer(q, k, v)

    # Step 1: both requests start (3 and 2 decoder tokens): their encoder K/V are written.
    q, out = run([3, 2], [0, 0], tables, kv=[0, 1])
    assert torch.allclose(out[:3], _reference(q[:3].view(3, HEADS, -1), *audio[0]), atol=1e-5)
    assert torch.allclose(out[3:], _reference(q[3:].view(2, HEADS, -1), *audio[1]), atol=1e-5)
    # Step 2: decodes and a prefill chunk, nothing written: read from the blocks.
    q, out = run([1, 4], [3, 2], tables, kv=[])
    assert torch.allclose(out[:1], _reference(q[:1].view(1, HEADS, -1), *audio[0]), atol=1e-5)
    assert torch.allclose(out[1:], _reference(q[1:].view(4, HEADS, -1), *audio[1]), atol=1e-5)
    # A third request holding the first one's blocks (same audio) reads its encoder K/V.
    q, out = run([1, 1], [4, 5], [tables[0], tables[0]], kv=[])
    for row in range(2):
        expected = _reference(q[row : row + 1].view(1, HEADS, -1), *audio[0])
        assert torch.allclose(out[row : row + 1], expected, atol=1e-5)
