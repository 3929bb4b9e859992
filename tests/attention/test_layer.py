from __future__ import annotations

import pytest
import torch
from torch import nn

from kvserve.attention.backends.registry import get_attn_backend
from kvserve.attention.backends.utils import make_common_attn_metadata
from kvserve.attention.layer import (
    Attention,
    allocate_kv_caches,
    bind_kv_cache,
    get_attention_layers,
    kv_cache_bytes_per_block,
)
from kvserve.forward_context import get_forward_context, set_forward_context


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = Attention(4, 8, 8**-0.5, 2, layer_name="layers.0.attn")
        self.b = Attention(4, 8, 8**-0.5, 2, layer_name="layers.1.attn")


def test_forward_context_required() -> None:
    with pytest.raises(RuntimeError, match="set_forward_context"):
        get_forward_context()
    with set_forward_context("md", kv_connector="conn", step=3) as ctx:
        assert get_forward_context() is ctx
        assert (ctx.attn_metadata, ctx.kv_connector, ctx.extra) == ("md", "conn", {"step": 3})
    with pytest.raises(RuntimeError):
        get_forward_context()


def test_allocate_bind_and_forward() -> None:
    model = TwoLayers()
    layers = get_attention_layers(model)
    assert list(layers) == ["layers.0.attn", "layers.1.attn"]
    assert kv_cache_bytes_per_block(model, 4, torch.float32) == 2 * (2 * 4 * 2 * 8 * 4)
    caches = allocate_kv_caches(model, num_blocks=3, block_size=4, device="cpu")
    bind_kv_cache(model, caches)
    assert model.a.kv_cache.data_ptr() == caches["layers.0.attn"].data_ptr()
    assert "kv_cache" not in str(model.state_dict().keys())

    common = make_common_attn_metadata([5], [0], [[2, 0]], 4)
    md = get_attn_backend("cpu").get_builder_cls()(4, "cpu").build(common)
    q, k, v = torch.randn(5, 32), torch.randn(5, 16), torch.randn(5, 16)
    with set_forward_context(md):
        paged = model.a(q, k, v)
    with set_forward_context(None):  # profile path: no cache, plain causal
        plain = model.a(q, k, v)
    torch.testing.assert_close(paged, plain)
    assert caches["layers.0.attn"][0, 2, 1].flatten().tolist() == k[1].tolist()
    assert caches["layers.1.attn"].abs().sum() == 0


def test_unbound_cache_and_missing_binding() -> None:
    model = TwoLayers()
    with pytest.raises(KeyError, match=r"layers\.1\.attn"):
        bind_kv_cache(model, {"layers.0.attn": torch.zeros(1)})
    md = (
        get_attn_backend("cpu")
        .get_builder_cls()(4, "cpu")
        .build(make_common_attn_metadata([1], [0], [[0]], 4))
    )
    with set_forward_context(md), pytest.raises(RuntimeError, match="not bound"):
        model.a(torch.randn(1, 32), torch.randn(1, 16), torch.randn(1, 16))
