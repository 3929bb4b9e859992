"""TieredCacheConnector under pipeline parallelism: PP=2 (mp workers, the batch queue on,
as by default) on a tiny random Llama, one decoder layer per stage, with a real Redis.
Each stage stores its own layer's KV under worker_id = its global rank; a second, fresh
set of engine processes finds the prefixes through both stages' lookup services, loads
them asynchronously (the stages agree on when every part is in), two micro-batches in
flight, and gives transformers' greedy tokens; so does the first engine loading them
synchronously once its prefix cache is dropped."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import redis

from kvserve.entrypoints.llm import LLM
from kvserve.kvcache.key import CacheEngineKey
from kvserve.kvcache.storage.redis_backend import VALUE_PREFIX
from kvserve.sampling_params import SamplingParams
from tests.entrypoints.test_llm_tiny_models import build_model, hf_greedy
from tests.kvcache.conftest import RedisServer

pytestmark = pytest.mark.slow

PP = 2
CHUNK = 8
HIT = 24  # three whole chunks of each 27-token prompt
MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _engine_run(
    path: Path, url: str, prompts: list[list[int]], passes: int = 1, **extra: Any
) -> tuple[list[list[list[int]]], list[list[int]], dict[str, Any], list[Any]]:
    """One engine (fresh engine core and stage processes), shut down before returning,
    runs the prompts ``passes`` times (dropping its prefix cache in between): per pass
    the tokens and cached tokens of each prompt; the connector's stats and each rank's
    tier_shard."""
    llm = LLM(
        str(path), pipeline_parallel_size=PP, distributed_executor_backend="mp", block_size=4,
        kv_cache_memory=8 << 20,
        kv_transfer_config={
            "kv_connector": "TieredCacheConnector",
            "kv_connector_extra_config": {
                "remote_url": url, "local_cpu": False, "chunk_size": CHUNK, **extra,
            },
        },
    )  # fmt: skip
    try:
        executor = llm.llm_engine.engine_core.engine_core.model_executor
        assert executor.max_concurrent_batches == PP  # the batch queue runs
        runs = []
        for i in range(passes):
            assert i == 0 or llm.reset_prefix_cache()
            runs.append(
                llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
            )
        connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
        stats = connector.get_kv_connector_stats()
        shards = executor.collective_rpc("tests.executor.rpc_functions:tier_shard")
    finally:
        llm.llm_engine.shutdown()
    tokens = [[list(o.outputs[0].token_ids) for o in outs] for outs in runs]
    return tokens, [[o.num_cached_tokens or 0 for o in outs] for outs in runs], stats, shards


def test_pp2_stages_share_their_layers_through_redis(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    reference = build_model("llama", tmp_path)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, reference.config.vocab_size) for _ in range(27)] for _ in "ab"]
    expected = [hf_greedy(reference, p, MAX_TOKENS) for p in prompts]

    tokens_a, cached_a, _, shards = _engine_run(tmp_path, redis_server.url, prompts, passes=2)
    # Stored in the first pass; loaded synchronously (start_load_kv) in the second.
    assert tokens_a == [expected, expected] and cached_a == [[0, 0], [HIT, HIT]]
    # (worker_id, KV heads per chunk, pins left): both KV heads, each stage its own rank.
    assert shards == [(rank, 2, 0) for rank in range(PP)]
    keys = [
        CacheEngineKey.from_string(k.decode().removeprefix(VALUE_PREFIX))
        for k in redis.Redis(port=redis_server.port).keys(VALUE_PREFIX + "*")
    ]
    # Every stage stored its own layer's part of every chunk of both prompts.
    assert sorted((k.world_size, k.worker_id) for k in keys) == sorted(
        (PP, rank) for rank in range(PP) for _ in range(len(prompts) * HIT // CHUNK)
    )

    tokens_b, cached_b, stats, shards = _engine_run(
        tmp_path, redis_server.url, prompts, enable_async_loading=True
    )
    assert shards == [(rank, 2, 0) for rank in range(PP)]  # every rank's pins released
    assert cached_b == [[HIT, HIT]]
    assert stats["lookup_tokens"]["hit"] == len(prompts) * HIT
    # Each stage loaded its part of every chunk from Redis.
    assert stats["tier_hits"]["redis"] == PP * len(prompts) * HIT // CHUNK
    assert tokens_b == [expected]
