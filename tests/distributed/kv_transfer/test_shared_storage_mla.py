"""SharedStorageConnector on MLA latent blocks: a DeepSeek-style model's engine core in
one process writes its prompt's latent blocks; an engine in this process that never saw
the prompt loads them and generates HF's tokens."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from kvserve.entrypoints.llm import LLM
from kvserve.sampling_params import SamplingParams
from tests.distributed.kv_transfer.helpers import as_json, entries, shared_storage
from tests.family_models import build_family_model, hf_greedy
from tests.reference import assert_no_leak

BLOCK_SIZE = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def test_latent_blocks_are_reused_across_processes(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    model_dir = tmp_path_factory.mktemp("deepseek_v3")
    reference = build_family_model("deepseek_v3", model_dir)
    storage = tmp_path_factory.mktemp("shared_latents")
    prompt = [(i * 37) % 150 + 3 for i in range(23)]  # 5 full blocks and a tail
    expected = hf_greedy(reference, prompt, GREEDY.max_tokens)
    kwargs = dict(
        skip_tokenizer_init=True,
        block_size=BLOCK_SIZE,
        kv_cache_memory=8 << 20,
        kv_transfer_config=as_json(shared_storage(storage)),
    )
    writer = LLM(str(model_dir), multiprocess_mode=True, **kwargs)  # engine core: a child process
    try:
        [written] = writer.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)
        assert written.num_cached_tokens == 0
        assert list(written.outputs[0].token_ids) == expected
    finally:
        writer.llm_engine.shutdown()

    [entry] = entries(storage)
    files = sorted((storage / entry).iterdir())
    latent = reference.config.kv_lora_rank + reference.config.qk_rope_head_dim
    assert len(files) == reference.config.num_hidden_layers
    with safe_open(str(files[0]), framework="pt") as f:
        # One latent per token: [1, blocks, block_size, kv_lora_rank + rope], no V.
        assert tuple(f.get_tensor("kv").shape) == (1, 5, BLOCK_SIZE, latent)

    reader = LLM(str(model_dir), **kwargs)
    try:
        [read] = reader.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)
        assert read.num_cached_tokens == 5 * BLOCK_SIZE  # all from the other process
        assert list(read.outputs[0].token_ids) == expected
        assert_no_leak(reader)
    finally:
        reader.llm_engine.shutdown()


def test_tiered_cache_refuses_latent_caches(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The KV tier stores per-head K/V chunks; an MLA model is refused at start-up, clearly."""
    model_dir = tmp_path_factory.mktemp("deepseek_v2")
    build_family_model("deepseek_v2", model_dir)
    tiered = json.dumps({"kv_connector": "TieredCacheConnector", "kv_connector_extra_config": {}})
    with pytest.raises(ValueError, match="cannot serve MLA latent caches"):
        LLM(str(model_dir), skip_tokenizer_init=True, kv_transfer_config=tiered)
