"""TieredCacheConnector end to end with the real model: CPU tier, Redis, the cache server,
the disk tier across restarts, a corrupt chunk, Redis stopped mid-run."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from kvserve.benchmarks.kvcache import make_document_ids
from kvserve.entrypoints.llm import LLM
from kvserve.kvcache.builder import CacheEngineBuilder
from kvserve.kvcache.storage.redis_backend import VALUE_PREFIX
from kvserve.sampling_params import SamplingParams
from tests.conftest import TEST_KV_CACHE_MEMORY
from tests.kvcache.conftest import RedisServer
from tests.reference import assert_no_leak

pytestmark = pytest.mark.slow

# Two whole 256-token chunks and a partial one: what crosses the tier is the same at any
# length, and every process here prefills the document.
DOC_TOKENS = 600
FULL_CHUNKS = DOC_TOKENS // 256 * 256  # 512: what a second ask loads from the tier
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def _transfer(**extra: Any) -> str:
    # JSON text, so llm_factory can key its engine cache on it.
    return json.dumps({"kv_connector": "TieredCacheConnector", "kv_connector_extra_config": extra})


def _ask(llm: Any, ids: list[int]) -> tuple[list[int], int]:
    out = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), out.num_cached_tokens or 0


def _cache_engine(llm: Any) -> Any:
    """The CacheEngine an in-process engine's connector shares (found by engine id)."""
    engine_id = llm.llm_engine.config.kv_transfer_config.engine_id
    return CacheEngineBuilder.get(engine_id)


def _write_here(extra: dict[str, Any], seed: int = 0) -> tuple[list[int], int]:
    """The first of two processes: an engine in this one asks the document, its tier
    flushed to the stores and the engine shut down before another process reads them
    (it starts no interpreter of its own, so costs the model load alone)."""
    llm = LLM(
        kv_cache_memory=TEST_KV_CACHE_MEMORY, kv_transfer_config=json.loads(_transfer(**extra))
    )
    try:
        answer = _ask(llm, make_document_ids(llm.get_tokenizer(), DOC_TOKENS, seed=seed))
        _cache_engine(llm).flush()
    finally:
        llm.llm_engine.shutdown()
    return answer


def _run_engine(extra: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.kvcache.engine_run",
            json.dumps({"extra": extra, "seed": seed, "num_tokens": DOC_TOKENS}),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).parents[2],
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise AssertionError(f"engine process failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def test_cpu_tier_serves_a_reset_prefix_cache(llm_factory: Callable[..., Any]) -> None:
    llm = llm_factory(kv_transfer_config=_transfer())
    ids = make_document_ids(llm.get_tokenizer(), DOC_TOKENS, seed=11)
    first, cached_first = _ask(llm, ids)
    assert cached_first == 0
    llm.reset_prefix_cache()
    second, cached_second = _ask(llm, ids)
    assert cached_second == FULL_CHUNKS  # all from the CPU tier: the local cache was reset
    assert second == first
    assert _cache_engine(llm).stats.tier("cpu").hits == FULL_CHUNKS // 256
    # The same totals ride on SchedulerStats, which the server exports in /metrics.
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    exported = scheduler.connector.get_kv_connector_stats()
    assert exported["tier_hits"]["cpu"] == FULL_CHUNKS // 256
    assert exported["lookup_tokens"]["hit"] >= FULL_CHUNKS
    # Asked a third time without a reset: the local prefix cache answers, not the tier.
    assert _ask(llm, ids)[0] == first
    assert_no_leak(llm)


def test_float16_kv_cache_round_trips_through_the_cpu_tier(
    llm_factory: Callable[..., Any],
) -> None:
    """--kv-cache-dtype float16: chunks are stored as the cache holds them and keyed by
    that dtype, so a reload gives back the same values and the same tokens."""
    llm = llm_factory(kv_transfer_config=_transfer(), kv_cache_dtype="float16")
    ids = make_document_ids(llm.get_tokenizer(), DOC_TOKENS, seed=12)
    first, _ = _ask(llm, ids)
    llm.reset_prefix_cache()
    second, cached = _ask(llm, ids)
    assert cached == FULL_CHUNKS
    assert second == first
    assert _cache_engine(llm).metadata.kv_dtype == "float16"
    assert_no_leak(llm)


def test_redis_shared_by_two_processes_and_disk_survives_restart(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    disk = str(tmp_path / "disk")
    tokens, cached = _write_here({"remote_url": redis_server.url, "local_disk": disk})
    assert cached == 0
    # A second engine process with only Redis: it reuses the first one's KV.
    via_redis = _run_engine({"remote_url": redis_server.url, "local_cpu": False})
    assert via_redis["num_cached_tokens"] == FULL_CHUNKS
    assert via_redis["tiers"]["redis"]["hits"] == FULL_CHUNKS // 256
    assert via_redis["tokens"] == tokens
    # A restarted engine with only the disk directory finds the chunks there.
    via_disk = _run_engine({"local_disk": disk, "local_cpu": False})
    assert via_disk["num_cached_tokens"] == FULL_CHUNKS
    assert via_disk["tiers"]["disk"]["hits"] == FULL_CHUNKS // 256
    assert via_disk["tokens"] == tokens


def test_cache_server_shared_by_two_processes(cache_server_factory: type) -> None:
    server = cache_server_factory("--max-memory", "1GiB")
    tokens, cached = _write_here({"remote_url": server.url}, seed=3)
    second = _run_engine({"remote_url": server.url, "local_cpu": False}, seed=3)
    assert cached == 0
    assert second["num_cached_tokens"] == FULL_CHUNKS
    assert second["tokens"] == tokens


def test_corrupt_chunk_and_redis_stopped_mid_run(
    llm_factory: Callable[..., Any], redis_server: RedisServer
) -> None:
    llm = llm_factory(
        kv_transfer_config=_transfer(
            remote_url=redis_server.url, local_cpu=False, remote_reconnect_interval_secs=0.2
        )
    )
    tok = llm.get_tokenizer()
    doc_a, doc_b, doc_c = (make_document_ids(tok, DOC_TOKENS, seed=s) for s in (21, 22, 23))
    want_a, _ = _ask(llm, doc_a)
    # Corrupt one stored chunk: lookup still counts it, the load finds it bad, the
    # scheduler recomputes from there, and the tokens stay right.
    raw = redis.Redis(port=redis_server.port)
    values = sorted(raw.keys(VALUE_PREFIX + "*"))
    assert len(values) == DOC_TOKENS // 256
    raw.setrange(values[0], 500, b"\x00garbage\x00")
    llm.reset_prefix_cache()
    assert _ask(llm, doc_a)[0] == want_a
    # Redis goes away: every request still succeeds, from recompute.
    redis_server.stop()
    llm.reset_prefix_cache()
    got_a, cached = _ask(llm, doc_a)
    assert got_a == want_a and cached == 0
    assert len(_ask(llm, doc_b)[0]) == GREEDY.max_tokens  # a new prompt succeeds too
    # Redis is back (empty): the tier stores and hits again.
    redis_server.start()
    time.sleep(0.3)  # past the reconnect interval
    want_c, _ = _ask(llm, doc_c)
    llm.reset_prefix_cache()
    got_c, cached_c = _ask(llm, doc_c)
    assert got_c == want_c and cached_c == FULL_CHUNKS
    assert_no_leak(llm)
