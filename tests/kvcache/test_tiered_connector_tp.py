"""TieredCacheConnector under tensor parallelism: TP=3 on SmolLM2 (3 KV heads, one per
rank; its 9 query heads do not split in 2) with the mp executor and a real Redis. Each
rank stores its own shard under worker_id = rank; a second, fresh set of engine
processes finds the whole prefix through every rank's lookup service, loads it, and
gives the first engine's and transformers' greedy tokens."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from kvserve.benchmarks.kvcache import make_document_ids
from kvserve.entrypoints.llm import LLM
from kvserve.kvcache.key import CacheEngineKey
from kvserve.kvcache.storage.redis_backend import VALUE_PREFIX
from kvserve.sampling_params import SamplingParams
from tests.conftest import TEST_KV_CACHE_MEMORY
from tests.kvcache.conftest import RedisServer
from tests.reference import hf_reference

pytestmark = pytest.mark.slow

TP = 3
DOC_TOKENS = 600
HIT = DOC_TOKENS // 256 * 256  # two whole chunks
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def _engine_run(
    url: str, ids: list[int], **extra: Any
) -> tuple[list[int], int, dict[str, Any], list[Any]]:
    """One engine (a fresh engine core and TP worker processes): tokens, cached tokens,
    the connector's exported stats and each rank's tier_shard; shut down before
    returning."""
    llm = LLM(
        tensor_parallel_size=TP,
        distributed_executor_backend="mp",
        kv_cache_memory=TEST_KV_CACHE_MEMORY,
        kv_transfer_config={
            "kv_connector": "TieredCacheConnector",
            "kv_connector_extra_config": {"remote_url": url, "local_cpu": False, **extra},
        },
    )
    try:
        out = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
        connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
        stats = connector.get_kv_connector_stats()
        executor = llm.llm_engine.engine_core.engine_core.model_executor
        shards = executor.collective_rpc("tests.executor.rpc_functions:tier_shard")
    finally:
        llm.llm_engine.shutdown()
    return list(out.outputs[0].token_ids), out.num_cached_tokens or 0, stats, shards


def test_tp3_engines_share_sharded_kv_through_redis(llm: Any, redis_server: RedisServer) -> None:
    ids = make_document_ids(llm.get_tokenizer(), DOC_TOKENS, seed=31)
    tokens_a, cached_a, _, shards = _engine_run(redis_server.url, ids)
    assert cached_a == 0
    # (worker_id, KV heads per chunk, pins left): one of SmolLM2's 3 KV heads per rank.
    assert shards == [(rank, 1, 0) for rank in range(TP)]
    keys = [
        CacheEngineKey.from_string(k.decode().removeprefix(VALUE_PREFIX))
        for k in redis.Redis(port=redis_server.port).keys(VALUE_PREFIX + "*")
    ]
    # Every rank stored its own shard of both chunks.
    assert sorted((k.world_size, k.worker_id) for k in keys) == sorted(
        (TP, rank) for rank in range(TP) for _ in range(HIT // 256)
    )
    # Engine B loads asynchronously: the ranks agree on when every shard is in.
    tokens_b, cached_b, stats, shards = _engine_run(
        redis_server.url, ids, enable_async_loading=True
    )
    assert shards == [(rank, 1, 0) for rank in range(TP)]  # every rank's pins released
    assert cached_b == HIT
    assert stats["lookup_tokens"]["hit"] == HIT
    assert stats["tier_hits"]["redis"] == TP * HIT // 256  # each rank loaded its shards
    assert tokens_b == tokens_a == hf_reference().greedy(ids, GREEDY.max_tokens)
