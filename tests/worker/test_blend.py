"""CacheBlend on a tiny random Llama (4 layers, float32): segment KV moved to new
positions equals freshly computed KV; ratio 1.0 is exactly a full prefill; the default
ratio reuses re-ordered documents and mostly keeps full prefill's first token."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve.kvcache.cache_engine import CacheEngine
from kvserve.kvcache.config import CacheEngineConfig
from kvserve.kvcache.key import CacheEngineMetadata
from kvserve.model_executor.layers.rotary_embedding import RotaryEmbedding
from kvserve.protocol.kv_blend import split_segments
from kvserve.sampling_params import SamplingParams
from kvserve.worker.blend_runner import SegmentKV
from tests.family_models import hf_greedy
from tests.kvcache.conftest import CacheServerProcess
from tests.reference import assert_no_leak

SEP = [3, 4]
VOCAB = 160
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
FIRST = SamplingParams(max_tokens=1, temperature=0.0)


def build_tiny_llama(path: Path) -> Any:
    """A 4-layer random Llama (no tokenizer) saved at path; the HF model in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config).float().eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("tiny_llama")
    return path, build_tiny_llama(path)


def _docs(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Token ids from 5 up: never a separator, BOS or EOS.
    return [[rng.randrange(5, VOCAB) for _ in range(rng.randrange(30, 70))] for _ in range(count)]


def _prompt(docs: list[list[int]], question: list[int]) -> list[int]:
    """BOS (a segment of its own, as a system prompt would be), the documents, the
    question, joined by the separator."""
    ids = [1, *SEP]
    for doc in docs:
        ids += doc + SEP
    return ids + question


@pytest.fixture(scope="module")
def blend_llm(tiny_llama: tuple[Path, Any]) -> Iterator[Any]:
    from kvserve.entrypoints.llm import LLM

    extra = {"enable_blending": True, "blend_separator_ids": "3,4", "chunk_size": 32}
    llm = LLM(
        str(tiny_llama[0]),
        skip_tokenizer_init=True,
        block_size=16,
        kv_cache_memory=16 << 20,
        enable_prefix_caching=False,
        kv_transfer_config=json.dumps(
            {"kv_connector": "TieredCacheConnector", "kv_connector_extra_config": extra}
        ),
    )
    yield llm
    llm.llm_engine.shutdown()


def _runner(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner


def _ask(llm: Any, ids: list[int], params: SamplingParams, **kv: Any) -> list[int]:
    if kv:
        params = params.clone()
        params.extra_args = {"kv_transfer_params": kv}
    out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids)


def test_split_segments() -> None:
    ids = [7, 8, 3, 4, 9, 3, 4, 3, 4, 10, 3, 11]
    assert split_segments(ids, SEP) == [(0, 2), (4, 5)]
    assert split_segments([5, 6], SEP) == []


@torch.inference_mode()
def _hf_kv(model: Any, doc: list[int], offset: int) -> torch.Tensor:
    """[layers, 2, n, kv heads, head dim] of doc alone at positions offset.."""
    positions = torch.arange(offset, offset + len(doc))[None]
    cache = model(torch.tensor([doc]), position_ids=positions, use_cache=True).cache
    layers = [(cache.layers[i].keys, cache.layers[i].values) for i in range(len(cache.layers))]
    return torch.stack([torch.stack([k[0], v[0]]).transpose(1, 2) for k, v in layers])


def test_segment_kv_at_other_offsets_equals_fresh_kv(tiny_llama: tuple[Path, Any]) -> None:
    """Position independence: a document's KV computed alone at offset 10, stored, and
    loaded at offsets 37 and 300 equals its KV computed alone at those offsets (float32:
    atol 2e-5, rtol 1e-4; the rotations' rounding)."""
    _, model = tiny_llama
    doc = _docs(1, 1)[0]
    n = len(doc)
    metadata = CacheEngineMetadata("tiny", 1, 0, "float32")
    engine = CacheEngine(CacheEngineConfig(chunk_size=32), metadata)
    block_size, kv_heads, head_dim = 16, 2, 16
    caches = [torch.zeros(2, 16, block_size, kv_heads, head_dim) for _ in range(4)]
    rotary = RotaryEmbedding(head_dim, head_dim, 10000.0, None, 1024)
    segments = SegmentKV(engine, caches, rotary)
    slots = torch.arange(5, 5 + n)
    at_10 = _hf_kv(model, doc, 10)
    for layer, cache in enumerate(caches):
        cache.view(2, -1, kv_heads, head_dim)[:, slots] = at_10[layer]
    segments.store(doc, 10, slots, ())
    assert engine.contains_segment(doc) and not engine.contains_segment(doc[1:])
    for offset in (37, 300):
        loaded = segments.load(doc, offset, ())
        assert loaded is not None
        torch.testing.assert_close(loaded, _hf_kv(model, doc, offset), atol=2e-5, rtol=1e-4)


def test_full_ratio_is_exactly_full_prefill(blend_llm: Any, tiny_llama: tuple[Path, Any]) -> None:
    docs = _docs(2, 3)
    question = [50, 51, 52]
    for doc in docs:  # each document alone: its segment is stored
        _ask(blend_llm, _prompt([doc], [60]), FIRST)
    shuffled = _prompt([docs[2], docs[0], docs[1]], question)
    want = hf_greedy(tiny_llama[1], shuffled, 4)
    stats = _runner(blend_llm).blend_runner.stats
    hits = stats.segment_hits
    assert _ask(blend_llm, shuffled, GREEDY, blend_recompute_ratio=1.0) == want
    assert stats.segment_hits == hits + 4  # BOS and 3 documents: found, none reused
    assert _ask(blend_llm, shuffled, GREEDY, blend=False) == want
    assert_no_leak(blend_llm)


def test_default_ratio_reuses_reordered_documents(
    blend_llm: Any, tiny_llama: tuple[Path, Any]
) -> None:
    """Held-back prompts (documents seen in another order): the first token matches full
    prefill on most of them, and every document is a hit."""
    model = tiny_llama[1]
    pool = _docs(3, 6)
    rng = random.Random(4)
    for doc in pool:
        _ask(blend_llm, _prompt([doc], [60]), FIRST)
    stats = _runner(blend_llm).blend_runner.stats
    hits, reused, recomputed = stats.segment_hits, stats.tokens_reused, stats.tokens_recomputed
    matches = 0
    prompts = 8
    for _ in range(prompts):
        chosen = rng.sample(pool, 3)
        ids = _prompt(chosen, [rng.randrange(5, VOCAB) for _ in range(4)])
        matches += _ask(blend_llm, ids, FIRST) == hf_greedy(model, ids, 1)
    assert stats.segment_hits == hits + 4 * prompts
    new_reused, new_recomputed = stats.tokens_reused - reused, stats.tokens_recomputed - recomputed
    # 15% of the cached tokens, rounded up per request.
    assert 0.15 <= new_recomputed / (new_reused + new_recomputed) < 0.2
    assert matches >= prompts * 3 // 4, f"{matches}/{prompts} first tokens match"
    # No reuse at all (ratio 0): still runs, and the query is recomputed.
    assert len(_ask(blend_llm, ids, GREEDY, blend_recompute_ratio=0.0)) == 4
    assert_no_leak(blend_llm)


def test_bad_blend_options_are_value_errors(blend_llm: Any) -> None:
    with pytest.raises(ValueError, match=r"kv_transfer_params\.blend "):
        _ask(blend_llm, [1, 5, 6], FIRST, blend="yes")
    with pytest.raises(ValueError, match=r"kv_transfer_params\.blend_recompute_ratio"):
        _ask(blend_llm, [1, 5, 6], FIRST, blend_recompute_ratio=1.5)
    assert _ask(blend_llm, [1, 5, 6], FIRST) == _ask(blend_llm, [1, 5, 6], FIRST, blend=False)
    assert_no_leak(blend_llm)


def test_blend_step_beside_decoding_and_plain_requests(
    blend_llm: Any, tiny_llama: tuple[Path, Any]
) -> None:
    """A blended prefill in the same steps as a decoding request and a plain prefill: the
    others keep exactly HF's tokens (only the blended request's tokens are selected)."""
    model = tiny_llama[1]
    docs = _docs(5, 2)
    for doc in docs:
        _ask(blend_llm, _prompt([doc], [60]), FIRST)
    engine = blend_llm.llm_engine
    decoding = [1, *_docs(6, 1)[0][:20]]
    plain = [1, *_docs(7, 1)[0]]
    blended = _prompt([docs[1], docs[0]], [70, 71])
    long = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine.add_request("decoding", {"prompt_token_ids": decoding}, long)
    outputs: dict[str, list[int]] = {}

    def step() -> None:
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)

    step()
    step()  # "decoding" is decoding now
    plain_params = GREEDY.clone()
    plain_params.extra_args = {"kv_transfer_params": {"blend": False}}
    engine.add_request("plain", {"prompt_token_ids": plain}, plain_params)
    engine.add_request("blended", {"prompt_token_ids": blended}, GREEDY)
    stats = _runner(blend_llm).blend_runner.stats
    reused = stats.tokens_reused
    while engine.has_unfinished_requests():
        step()
    assert stats.tokens_reused > reused  # the blended prefill reused KV in that step
    assert outputs["decoding"] == hf_greedy(model, decoding, 12)
    assert outputs["plain"] == hf_greedy(model, plain, 4)
    assert len(outputs["blended"]) == 4
    assert_no_leak(blend_llm)


def test_chunked_prefill_blends_each_chunk_and_keeps_exact_prefixes_apart(
    tiny_llama: tuple[Path, Any],
) -> None:
    """A 64-token budget splits the prompt into chunks: the segments wholly inside a
    chunk are blended (re-ordered documents still hit), 100% recompute stays exactly
    full prefill, and with prefix caching on a blended prompt's approximate KV never
    becomes a prefix-cache hit for an exact request, while exact prompts still share."""
    from kvserve.entrypoints.llm import LLM

    path, model = tiny_llama
    extra = {"enable_blending": True, "blend_separator_ids": "3,4", "chunk_size": 32}
    llm = LLM(
        str(path),
        skip_tokenizer_init=True,
        block_size=16,
        kv_cache_memory=16 << 20,
        max_num_batched_tokens=64,
        kv_transfer_config=json.dumps(
            {"kv_connector": "TieredCacheConnector", "kv_connector_extra_config": extra}
        ),
    )
    try:
        docs = [doc[:40] for doc in _docs(11, 3)]  # 42-token segments: one fits a chunk
        for doc in docs:
            _ask(llm, _prompt([doc], [60]), FIRST)
        ids = _prompt([docs[2], docs[0], docs[1]], [70, 71])
        assert len(ids) > 2 * 64  # three chunks
        stats = _runner(llm).blend_runner.stats
        hits, reused = stats.segment_hits, stats.tokens_reused

        def run(params: SamplingParams, **kv: Any) -> tuple[list[int], int]:
            if kv:
                params = params.clone()
                params.extra_args = {"kv_transfer_params": kv}
            out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
            return list(out.outputs[0].token_ids), out.num_cached_tokens or 0

        want = hf_greedy(model, ids, 4)
        assert run(GREEDY, blend_recompute_ratio=1.0)[0] == want
        blended, _ = run(GREEDY)
        assert len(blended) == 4
        assert stats.segment_hits > hits and stats.tokens_reused > reused
        exact, cached = run(GREEDY, blend=False)
        assert cached == 0  # nothing of the blended runs was a prefix-cache entry
        assert exact == want
        again, cached = run(GREEDY, blend=False)
        assert cached > 0 and again == want  # exact blocks are still shared
        assert_no_leak(llm)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("tier", ["disk", "cache_server"])
def test_segments_survive_a_restart_on_the_disk_and_remote_tiers(
    tiny_llama: tuple[Path, Any], tmp_path: Path, tier: str
) -> None:
    """Segments are ordinary tier chunks: an engine whose only tier is the disk or a
    real cache server stores them, and a new one on the same store (a restarted engine,
    or another instance) loads them, moved to a new offset."""
    _, model = tiny_llama
    doc = _docs(9, 1)[0]  # more than one 32-token chunk, with a short last one
    metadata = CacheEngineMetadata("tiny", 1, 0, "float32")
    server = CacheServerProcess() if tier == "cache_server" else None
    config = CacheEngineConfig(
        chunk_size=32,
        local_cpu=False,
        local_disk=None if server else str(tmp_path),
        remote_url=server.url if server else None,
    )
    caches = [torch.zeros(2, 16, 16, 2, 16) for _ in range(4)]
    rotary = RotaryEmbedding(16, 16, 10000.0, None, 1024)
    slots = torch.arange(len(doc))
    fresh = _hf_kv(model, doc, 0)
    for layer, cache in enumerate(caches):
        cache.view(2, -1, 2, 16)[:, slots] = fresh[layer]
    first = CacheEngine(config, metadata)
    SegmentKV(first, caches, rotary).store(doc, 0, slots, ())
    first.flush(timeout=30)
    first.close()
    restarted = CacheEngine(config, metadata)
    try:
        loaded = SegmentKV(restarted, caches, rotary).load(doc, 90, ())
        assert loaded is not None
        torch.testing.assert_close(loaded, _hf_kv(model, doc, 90), atol=2e-5, rtol=1e-4)
        assert restarted.stats.tier(tier).hits == -(-len(doc) // 32)
    finally:
        restarted.close()
        if server is not None:
            server.stop()
