from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from kvserve.model_executor.layers import linear, vocab_parallel_embedding
from kvserve.model_executor.layers.activation import SiluAndMul
from kvserve.model_executor.layers.layernorm import RMSNorm
from kvserve.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from kvserve.model_executor.layers.rotary_embedding import compute_inv_freq, get_rope
from kvserve.model_executor.layers.vocab_parallel_embedding import ParallelLMHead


def _fake_tp(monkeypatch: pytest.MonkeyPatch, rank: int, size: int) -> None:
    for module in (linear, vocab_parallel_embedding):
        monkeypatch.setattr(module, "get_tp_rank_size", lambda: (rank, size))


def _load(layer: torch.nn.Module, name: str, tensor: torch.Tensor, *shard: object) -> None:
    param = getattr(layer, name)
    param.weight_loader(param, tensor, *shard)


@pytest.mark.parametrize("rank", [0, 1])
def test_column_and_row_shards(monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    _fake_tp(monkeypatch, rank, 2)
    full = torch.arange(8 * 6, dtype=torch.float32).view(8, 6)
    col = ColumnParallelLinear(6, 8, bias=True)
    _load(col, "weight", full)
    _load(col, "bias", torch.arange(8.0))
    assert torch.equal(col.weight, full[rank * 4 : rank * 4 + 4])
    assert torch.equal(col.bias, torch.arange(8.0)[rank * 4 : rank * 4 + 4])
    row = RowParallelLinear(6, 8, bias=True)
    _load(row, "weight", full)
    _load(row, "bias", torch.ones(8))
    assert torch.equal(row.weight, full[:, rank * 3 : rank * 3 + 3])
    assert torch.equal(row.bias, torch.ones(8))  # replicated


def test_merged_and_qkv_shards_with_kv_replication(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_tp(monkeypatch, 3, 4)
    merged = MergedColumnParallelLinear(2, [8, 8])
    gate, up = torch.randn(8, 2), torch.randn(8, 2)
    _load(merged, "weight", gate, 0)
    _load(merged, "weight", up, 1)
    assert torch.equal(merged.weight, torch.cat([gate[6:], up[6:]]))

    # 8 query heads, 2 KV heads over 4 ranks: each KV head lives on 2 ranks.
    qkv = QKVParallelLinear(hidden_size=3, head_size=2, total_num_heads=8, total_num_kv_heads=2)
    assert (qkv.num_heads, qkv.num_kv_heads, qkv.weight.shape[0]) == (2, 1, 8)
    q, k, v = torch.randn(16, 3), torch.randn(4, 3), torch.randn(4, 3)
    for shard_id, tensor in (("q", q), ("k", k), ("v", v)):
        _load(qkv, "weight", tensor, shard_id)
    assert torch.equal(qkv.weight, torch.cat([q[12:16], k[2:4], v[2:4]]))


def test_vocab_parallel_embedding_masks_other_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_tp(monkeypatch, 1, 2)
    head = ParallelLMHead(5, 2)  # rank 1 holds rows 3..4 plus one zero pad row
    table = torch.arange(10.0).view(5, 2)
    _load(head, "weight", table)
    assert torch.equal(head.weight, torch.tensor([[6.0, 7.0], [8.0, 9.0], [0.0, 0.0]]))
    out = vocab_parallel_embedding.VocabParallelEmbedding.forward(head, torch.tensor([0, 4]))
    assert torch.equal(out, torch.tensor([[0.0, 0.0], [8.0, 9.0]]))


def test_qkv_forward_matches_separate_projections() -> None:
    qkv = QKVParallelLinear(4, 2, 2, 1, bias=True)
    parts = {s: (torch.randn(n, 4), torch.randn(n)) for s, n in (("q", 4), ("k", 2), ("v", 2))}
    for shard_id, (w, b) in parts.items():
        _load(qkv, "weight", w, shard_id)
        _load(qkv, "bias", b, shard_id)
    x = torch.randn(3, 4)
    expected = torch.cat([x @ w.T + b for w, b in parts.values()], dim=-1)
    torch.testing.assert_close(qkv(x), expected)


def test_rmsnorm_residual_and_silu() -> None:
    norm = RMSNorm(4, eps=1e-6)
    x, r = torch.randn(3, 4), torch.randn(3, 4)
    out, summed = norm(x.clone(), r.clone())  # the fused form may work in place
    torch.testing.assert_close(summed, x + r)
    torch.testing.assert_close(out, norm(x + r))
    y = torch.randn(2, 6)
    torch.testing.assert_close(SiluAndMul()(y), torch.nn.functional.silu(y[:, :3]) * y[:, 3:])


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "default", "rope_theta": 500000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ],
)
def test_inv_freq_matches_transformers(params: dict) -> None:
    config = LlamaConfig(hidden_size=512, num_attention_heads=4, rope_parameters=params)
    expected = LlamaRotaryEmbedding(config).inv_freq
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    ours = compute_inv_freq(128, params["rope_theta"], scaling)
    torch.testing.assert_close(ours, expected.float())
    rope = get_rope(128, params["rope_theta"], scaling)
    q, k = rope(torch.tensor([0, 5]), torch.randn(2, 256), torch.randn(2, 128))
    assert q.shape == (2, 256) and k.shape == (2, 128)
