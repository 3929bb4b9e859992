"""CacheBlend under tensor parallelism: TP=3 on SmolLM2 (one KV head per rank), mp
executor. Every rank stores and loads its own heads of each segment; the ranks agree on
the hits and sum their deviations, so they recompute the same tokens. Ratio 1.0 gives
exactly full prefill's tokens, and re-ordered documents are tier hits on every rank."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvserve.benchmarks.kvcache import make_document_ids
from kvserve.entrypoints.llm import LLM
from kvserve.sampling_params import SamplingParams
from tests.conftest import TEST_KV_CACHE_MEMORY

pytestmark = pytest.mark.slow

TP = 3
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _ask(llm: Any, ids: list[int], **kv: Any) -> list[int]:
    params = GREEDY.clone()
    params.extra_args = {"kv_transfer_params": kv}
    out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids)


def test_tp3_blend() -> None:
    llm = LLM(
        tensor_parallel_size=TP,
        distributed_executor_backend="mp",
        kv_cache_memory=TEST_KV_CACHE_MEMORY,
        enable_prefix_caching=False,
        kv_transfer_config={
            "kv_connector": "TieredCacheConnector",
            "kv_connector_extra_config": {"enable_blending": True},
        },
    )
    try:
        tokenizer = llm.get_tokenizer()
        sep = tokenizer.encode(" # # ", add_special_tokens=False)
        system = tokenizer.encode("Answer from the documents.", add_special_tokens=False)
        rng = random.Random(8)
        docs = [make_document_ids(tokenizer, rng.randint(120, 200), seed=60 + i) for i in range(3)]
        for doc in docs:
            _ask(llm, [*system, *sep, *doc, *sep])
        ids = list(system)
        for doc in (docs[2], docs[0], docs[1]):
            ids += [*sep, *doc]
        ids += [*sep, *tokenizer.encode("Which place comes first?", add_special_tokens=False)]
        connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
        full = _ask(llm, ids, blend=False)
        assert _ask(llm, ids, blend_recompute_ratio=1.0) == full
        hits = connector.get_kv_connector_stats()["tier_hits"]["cpu"]
        blended = _ask(llm, ids)
        # 4 one-chunk segments (system + 3 documents), loaded on each of the 3 ranks.
        assert connector.get_kv_connector_stats()["tier_hits"]["cpu"] - hits == 4 * TP
        assert blended[0] == full[0]
    finally:
        llm.llm_engine.shutdown()
