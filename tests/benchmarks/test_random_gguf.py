"""Random-weight GGUF files: a tiny shape through the same code path as Llama-3.2-1B's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from kvserve.benchmarks.random_gguf import (
    MIXES,
    SHAPES,
    LlamaShape,
    ensure_random_gguf,
    llama3_rope_factors,
    random_blocks,
    use_more_bits,
    write_random_gguf,
)
from kvserve.transformers_utils.arch_config import load_arch_config
from kvserve.transformers_utils.gguf_reader import open_gguf
from kvserve.transformers_utils.model_resolver import resolve_model
from tests.reference import hf_float32_model

Q = GGMLQuantizationType
# Llama-3.2-1B's proportions at toy size; the vocabulary just past the packaged
# tokenizer's 49152 tokens, so padding is exercised.
TINY = LlamaShape("tiny-llama", 64, 2, 4, 2, 128, 49152 + 64)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_random_gguf(TINY, tmp_path_factory.mktemp("random_gguf"))


def test_tensors_have_the_declared_shapes_and_types(tiny_gguf: Path) -> None:
    tensors = {t.name: t for t in open_gguf(str(tiny_gguf)).tensors}
    h, kv, inter = TINY.hidden_size, TINY.num_kv_heads * TINY.head_dim, TINY.intermediate_size
    want = {
        "token_embd.weight": ((h, TINY.vocab_size), Q.Q8_0),
        "rope_freqs.weight": ((TINY.head_dim // 2,), Q.F32),
        "output_norm.weight": ((h,), Q.F32),
    }
    for i in range(TINY.num_layers):
        want |= {
            f"blk.{i}.attn_norm.weight": ((h,), Q.F32),
            f"blk.{i}.ffn_norm.weight": ((h,), Q.F32),
            f"blk.{i}.attn_q.weight": ((h, h), Q.Q4_1),
            f"blk.{i}.attn_k.weight": ((h, kv), Q.Q4_1),
            f"blk.{i}.attn_v.weight": ((h, kv), Q.Q4_1),
            f"blk.{i}.attn_output.weight": ((h, h), Q.Q4_1),
            f"blk.{i}.ffn_gate.weight": ((h, inter), Q.Q4_1),
            f"blk.{i}.ffn_up.weight": ((h, inter), Q.Q4_1),
            f"blk.{i}.ffn_down.weight": ((inter, h), Q.Q4_1),
        }
    assert {n: (tuple(t.shape), t.tensor_type) for n, t in tensors.items()} == want
    # Valid blocks of initializer-sized weights: finite, about the intended spread.
    w = dequantize(np.asarray(tensors["blk.0.ffn_up.weight"].data), Q.Q4_1)
    assert np.isfinite(w).all() and 0.01 < float(w.std()) < 0.04


def test_config_matches_the_shape(tiny_gguf: Path) -> None:
    arch = load_arch_config(resolve_model(str(tiny_gguf)))
    assert (arch.hidden_size, arch.num_hidden_layers, arch.intermediate_size) == (64, 2, 128)
    assert (arch.num_attention_heads, arch.num_key_value_heads) == (4, 2)
    assert arch.vocab_size == TINY.vocab_size and arch.tie_word_embeddings
    assert arch.rope_theta == 500000.0
    assert arch.rope_scaling is not None
    assert arch.rope_scaling["freq_factors"] == llama3_rope_factors(TINY).tolist()


def test_rope_factors_are_transformers_llama3_scaling() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    shape = SHAPES["llama-3.2-1b"]
    s = shape.rope_scaling
    assert s is not None
    rope = {"rope_type": "llama3", "rope_theta": shape.rope_theta, "factor": s.factor,
            "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings}  # fmt: skip
    config = LlamaConfig(
        hidden_size=shape.hidden_size, num_attention_heads=shape.num_heads, rope_parameters=rope
    )
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    dim = shape.head_dim
    plain = 1.0 / shape.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    torch.testing.assert_close(
        plain.float() / torch.from_numpy(llama3_rope_factors(shape)), inv_freq.float()
    )


def test_loads_in_kvserve_with_the_packaged_tokenizer_padded(tiny_gguf: Path) -> None:
    from kvserve.entrypoints.llm import LLM
    from kvserve.sampling_params import SamplingParams
    from kvserve.transformers_utils.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(resolve_model(str(tiny_gguf)))
    assert len(tokenizer) == TINY.vocab_size
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    assert tokenizer.decode(ids) == "Hello world"
    llm = LLM(str(tiny_gguf), kv_cache_memory=4 << 20, max_model_len=64)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        out = llm.generate("Hello world", params, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.llm_engine.shutdown()


def test_written_once_then_reused(tiny_gguf: Path) -> None:
    before = tiny_gguf.stat().st_mtime_ns
    assert ensure_random_gguf(TINY, tiny_gguf.parent) == tiny_gguf
    assert tiny_gguf.stat().st_mtime_ns == before
    assert [p.name for p in tiny_gguf.parent.iterdir()] == [tiny_gguf.name]  # no temporaries


def test_bad_input_names_the_field(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="qtype"):
        random_blocks(rng, 2, 256, Q.Q5_K)
    with pytest.raises(ValueError, match="cols"):
        random_blocks(rng, 2, 48, Q.Q4_1)
    with pytest.raises(ValueError, match="cols"):
        random_blocks(rng, 2, 128, Q.Q4_K)
    block, size = GGML_QUANT_SIZES[Q.Q4_1]
    assert random_blocks(rng, 3, 64, Q.Q4_1).shape == (3, 64 // block * size)
    small = LlamaShape("small-vocab", 64, 1, 4, 2, 128, 1000)
    with pytest.raises(ValueError, match="vocab_size"):
        write_random_gguf(tmp_path / "small.gguf", small)


def test_use_more_bits_is_llamacpps_choice() -> None:
    # Llama-3.2-1B's 16 layers: the first and last two, and every third one between.
    assert [i for i in range(16) if use_more_bits(i, 16)] == [0, 1, 4, 7, 10, 13, 14, 15]


# Q4_K_M at a shape K-quants fit (rows of 256), the embedding tied as Llama-3.2-1B's;
# plain RoPE, which transformers' GGUF loader reads (it leaves rope_freqs out).
TINY_K = LlamaShape("tiny-llama-k", 256, 8, 4, 2, 512, 49152 + 64, rope_scaling=None)
PROMPT = [1, 504, 3059, 30, 2523, 314]


@pytest.fixture(scope="module")
def tiny_q4_k_m(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    """The file and transformers' float32 greedy tokens on gguf's dequantization of it."""
    path = ensure_random_gguf(TINY_K, tmp_path_factory.mktemp("random_gguf"), MIXES["Q4_K_M"])
    hf = hf_float32_model(path)
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, min_new_tokens=8
        )
    return path, out[0, len(PROMPT) :].tolist()


def test_q4_k_m_places_k_quants_as_llamacpp(tiny_q4_k_m: tuple[Path, list[int]]) -> None:
    path, _ = tiny_q4_k_m
    assert path.name == "tiny-llama-k-random.Q4_K_M.gguf"
    reader = open_gguf(str(path))
    assert reader.fields["general.file_type"] == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["token_embd.weight"] == Q.Q6_K  # the tied head: llama.cpp's output type
    more = {0, 3, 6, 7}  # use_more_bits for 8 layers
    for i in range(TINY_K.num_layers):
        want = Q.Q6_K if i in more else Q.Q4_K
        assert (types[f"blk.{i}.attn_v.weight"], types[f"blk.{i}.ffn_down.weight"]) == (want, want)
        for name in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            assert types[f"blk.{i}.{name}.weight"] == Q.Q4_K
    tensors = {t.name: t for t in reader.tensors}
    for name, qtype in (("blk.0.ffn_up.weight", Q.Q4_K), ("blk.0.ffn_down.weight", Q.Q6_K)):
        w = dequantize(np.asarray(tensors[name].data), qtype)
        assert np.isfinite(w).all() and 0.01 < float(w.std()) < 0.04
        assert abs(float(w.mean())) < 0.005


@pytest.mark.parametrize("tp", [1, 2])
def test_q4_k_m_greedy_tokens_are_transformers(
    tiny_q4_k_m: tuple[Path, list[int]], tp: int
) -> None:
    """kvserve's lossless path on these blocks is transformers' float32 model on gguf's
    dequantization of them: with q/k (Q4_K) and v (Q6_K) of one fused projection in
    different block types (half the layers), on one rank and on two (each rank's rows of
    every shard)."""
    from kvserve.entrypoints.llm import LLM
    from kvserve.sampling_params import SamplingParams

    path, expected = tiny_q4_k_m
    llm = LLM(str(path), kv_cache_memory=4 << 20, max_model_len=64, tensor_parallel_size=tp)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        out = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
        assert list(out[0].outputs[0].token_ids) == expected
    finally:
        llm.llm_engine.shutdown()
