"""Multi-head Latent Attention: the cache spec (one latent per token and layer), the
absorbed decode path against the expanded one, and an MLA model's KV accounting."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType

from kvserve.attention.backends.mla_cpu import CPUMLABackend, CPUMLAImpl
from kvserve.attention.backends.utils import make_common_attn_metadata
from kvserve.attention.mla import MLAAttention
from kvserve.entrypoints.llm import LLM
from kvserve.model_executor.layers.block_weight import BlockWeight
from kvserve.model_executor.layers.linear import ColumnParallelLinear
from kvserve.protocol.kv_cache_interface import (
    FullAttentionSpec,
    MLAAttentionSpec,
    build_kv_cache_config,
    kv_bytes_per_token,
    max_tokens_per_request,
)
from kvserve.transformers_utils.arch_families import MLAConfig
from tests.family_models import build_family_model
from tests.kernel_support import require_kernels

KV_LORA, ROPE, NOPE, V, HEADS = 16, 8, 16, 16, 4


def test_spec_page_is_the_latent_only() -> None:
    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=KV_LORA + ROPE, dtype_size=4)
    assert spec.page_size_bytes == 16 * (KV_LORA + ROPE) * 4  # no separate V
    assert spec.attends_to_all and spec.type_id.startswith("mla_attention")
    mha = FullAttentionSpec(block_size=16, num_kv_heads=HEADS, head_size=NOPE + ROPE, dtype_size=4)
    assert mha.page_size_bytes == 2 * 16 * HEADS * (NOPE + ROPE) * 4
    with pytest.raises(ValueError, match="one latent"):
        MLAAttentionSpec(block_size=16, num_kv_heads=2, head_size=8)
    config = build_kv_cache_config({"l0": spec, "l1": spec}, 1 << 20)
    assert kv_bytes_per_token(config) == 2 * (KV_LORA + ROPE) * 4
    # Full-attention rules: the request holds a block per block_size tokens.
    assert max_tokens_per_request(config, 64) == (config.num_blocks - 1) * 16


def _paged_latents(num_tokens: int, block_size: int) -> tuple[torch.Tensor, list[int]]:
    blocks = list(range(7, 7 + -(-num_tokens // block_size)))[::-1]  # non-contiguous order
    cache = torch.zeros(CPUMLABackend.get_kv_cache_shape(16, block_size, 1, KV_LORA + ROPE))
    return cache, blocks


def test_absorbed_decode_equals_expanded_attention() -> None:
    torch.manual_seed(0)
    mla = MLAConfig(
        kv_lora_rank=KV_LORA, q_lora_rank=None, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
        v_head_dim=V,
    )  # fmt: skip
    impl = CPUMLAImpl(HEADS, 0.2, mla)
    w = torch.randn(HEADS, NOPE + V, KV_LORA) * 0.3

    class Layer(torch.nn.Module):
        def kv_b_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
            return w[:, :NOPE], w[:, NOPE:]

    layer, block_size, context = Layer(), 4, 11
    latents = torch.randn(context, 1, KV_LORA + ROPE)
    queries = torch.randn(context, HEADS, NOPE + ROPE)
    cache, blocks = _paged_latents(context, block_size)
    builder = CPUMLABackend.get_builder_cls()(block_size, "cpu")
    # Prefill the first 10 tokens (expanded), then decode the 11th (absorbed).
    prefill = builder.build(make_common_attn_metadata([10], [0], [blocks], block_size))
    impl.forward(layer, queries[:10], latents[:10], latents.new_empty(0), cache, prefill)
    decode = builder.build(make_common_attn_metadata([1], [10], [blocks], block_size))
    assert decode.decode is not None and not decode.prefills
    got = impl.forward(layer, queries[10:], latents[10:], latents.new_empty(0), cache, decode)
    expected = impl.expanded(queries, latents[:, 0], None, *layer.kv_b_weights())[10:]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # The cache holds exactly the latents, at their slots.
    stored = cache[0][torch.tensor(blocks)].reshape(-1, KV_LORA + ROPE)[:context]
    assert torch.equal(stored, latents[:, 0])


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("deepseek_v2")
    return path, build_family_model("deepseek_v2", path)


def test_mla_model_caches_one_latent_per_token(
    deepseek: tuple[Path, Any], caplog: pytest.LogCaptureFixture
) -> None:
    path, reference = deepseek
    config = reference.config
    with caplog.at_level(logging.INFO):
        llm = LLM(str(path), skip_tokenizer_init=True, block_size=16, kv_cache_memory=1 << 20)
    try:
        core = llm.llm_engine.engine_core.engine_core
        kv_config = core.kv_cache_config
        [group] = kv_config.kv_cache_groups
        spec = group.kv_cache_spec
        latent = config.kv_lora_rank + config.qk_rope_head_dim
        assert isinstance(spec, MLAAttentionSpec)
        assert spec.page_size_bytes == spec.block_size * latent * 4
        layers = config.num_hidden_layers
        assert kv_bytes_per_token(kv_config) == layers * latent * 4
        # Per-head K and V (4 heads of 24) would cost 2 * 4 * 24 values a token, not 24.
        qk_head = config.qk_nope_head_dim + config.qk_rope_head_dim
        mha = layers * 2 * config.num_attention_heads * qk_head * 4
        assert mha / kv_bytes_per_token(kv_config) == 8
        assert f"{(1 << 30) // (layers * latent * 4)} tokens per GiB" in caplog.text
    finally:
        llm.llm_engine.shutdown()


def test_quantized_kv_b_proj_is_read_dequantized() -> None:
    """--quantization drops kv_b_proj's float weight; the layer reads its blocks instead."""
    require_kernels()
    mla = MLAConfig(
        kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
        v_head_dim=V,
    )  # fmt: skip
    kv_b = ColumnParallelLinear(32, HEADS * (NOPE + V))
    with torch.no_grad():
        kv_b.weight.normal_()
    layer = MLAAttention(HEADS, 0.2, mla, kv_b, "layers.0.attn")
    float_uk, float_uv = (w.clone() for w in layer.kv_b_weights())
    kv_b.quant_weight = BlockWeight.quantize(kv_b.weight, GGMLQuantizationType.Q8_0)
    kv_b.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    w_uk, w_uv = layer.kv_b_weights()
    assert w_uk.shape == float_uk.shape and w_uv.shape == float_uv.shape
    torch.testing.assert_close(w_uk, float_uk, atol=0.05, rtol=0.05)  # Q8_0 rounding
    assert layer.kv_b_weights()[0].data_ptr() == w_uk.data_ptr()  # dequantized once
