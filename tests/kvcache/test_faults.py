"""Faults in the KV cache tier while a real engine serves, each with its outcome asserted.

- Redis or the cache server SIGKILLed mid-run (while chunks load and store): every
  request still completes with the exact greedy tokens (a dead tier is a miss, the
  scheduler recomputes), within a bound rather than hanging.
- Redis frozen (SIGSTOP): the backend's blocking timeout turns each call into a miss.
- A chunk file on disk corrupted: its checksum fails, it is a miss and removed, never served.
- The disk tier hitting RLIMIT_FSIZE in a child process (SIGXFSZ ignored): the write
  fails as a store error, no partial or temporary file remains, later reads are misses.

The engine core's own SIGKILL is tests/entrypoints/openai/test_auth_and_engine_death.py;
the UniProc executor has no worker processes to kill.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvserve.benchmarks.kvcache import make_document_ids
from kvserve.entrypoints.llm import LLM
from kvserve.kvcache.builder import CacheEngineBuilder
from kvserve.kvcache.stats import TierStats
from kvserve.kvcache.storage.disk_store import SUFFIX
from kvserve.sampling_params import SamplingParams
from tests.conftest import TEST_KV_CACHE_MEMORY
from tests.kvcache.conftest import CacheServerProcess, RedisServer
from tests.reference import assert_no_leak

pytestmark = pytest.mark.slow

# Two full 256-token chunks and a partial one each: every fault below needs a document of
# several chunks, not a long one (each engine here prefills them again and again).
DOC_TOKENS = 600
CHUNK_TOKENS = DOC_TOKENS // 256 * 256
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
HANG_LIMIT_S = 300.0  # generous on a loaded 2-core machine: this catches hangs, not speed


def _tiered_llm(**extra: Any) -> LLM:
    return LLM(
        kv_cache_memory=TEST_KV_CACHE_MEMORY,
        kv_transfer_config={
            "kv_connector": "TieredCacheConnector",
            "kv_connector_extra_config": {"remote_reconnect_interval_secs": 0.2, **extra},
        },
    )


@pytest.fixture
def tiered_llm() -> Iterator[Callable[..., LLM]]:
    """Engines with a tier, shut down after the test (each holds its own KV cache)."""
    made: list[LLM] = []

    def make(**extra: Any) -> LLM:
        made.append(_tiered_llm(**extra))
        return made[-1]

    yield make
    for llm in made:
        llm.llm_engine.shutdown()


def _tier(llm: LLM, name: str) -> TierStats:
    engine_id = llm.llm_engine.config.kv_transfer_config.engine_id
    return CacheEngineBuilder.get(engine_id).stats.tier(name)


def _generate(llm: LLM, docs: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """(tokens, cached tokens) per doc; fails, rather than blocks, if the engine hangs."""
    box: dict[str, Any] = {}

    def run() -> None:
        prompts = [{"prompt_token_ids": d} for d in docs]
        box["out"] = llm.generate(prompts, GREEDY, use_tqdm=False)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HANG_LIMIT_S)
    assert not thread.is_alive(), f"generate did not return within {HANG_LIMIT_S} s"
    outs = box["out"]
    return [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens or 0 for o in outs]


class KillWhen(threading.Thread):
    """Sends `signum` to `pid` as soon as `ready()` holds (polled), at most once."""

    def __init__(self, pid: int, ready: Callable[[], bool], signum: int = signal.SIGKILL) -> None:
        super().__init__(daemon=True)
        self.pid, self.ready, self.signum = pid, ready, signum
        self.fired = threading.Event()
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            if self.ready():
                os.kill(self.pid, self.signum)
                self.fired.set()
                return
            time.sleep(0.002)


@pytest.fixture(scope="module")
def docs(llm: Any) -> list[list[int]]:
    return [make_document_ids(llm.get_tokenizer(), DOC_TOKENS, seed=s) for s in (41, 42, 43)]


@pytest.fixture(scope="module")
def want(llm: Any, docs: list[list[int]]) -> list[list[int]]:
    """The tokens of an engine without any tier: what every faulty run must produce."""
    return _generate(llm, docs)[0]


@pytest.mark.parametrize("remote", ["redis", "cache_server"])
def test_remote_tier_sigkilled_mid_run_is_a_miss_not_an_error(
    remote: str,
    request: pytest.FixtureRequest,
    tiered_llm: Callable[..., LLM],
    docs: list[list[int]],
    want: list[list[int]],
) -> None:
    if remote == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        url, proc = server.url, server.proc
    else:
        factory: type[CacheServerProcess] = request.getfixturevalue("cache_server_factory")
        cache_server = factory("--max-memory", "1GiB")
        url, proc = cache_server.url, cache_server.proc
    assert proc is not None
    llm = tiered_llm(remote_url=url, local_cpu=False, blocking_timeout_secs=2.0)
    name = "redis" if remote == "redis" else "cache_server"
    # Two documents stored while the tier is alive.
    assert _generate(llm, docs[:2])[0] == want[:2]
    assert _tier(llm, name).bytes_stored > 0
    # The tier dies under the next batch, on its first hit: loads and stores after that fail.
    llm.reset_prefix_cache()
    killer = KillWhen(proc.pid, lambda: _tier(llm, name).hits > 0)
    killer.start()
    try:
        tokens, _ = _generate(llm, docs)
    finally:
        killer.stop.set()
    assert killer.fired.is_set(), "the tier was never hit, so never killed mid-run"
    assert proc.wait(timeout=10) == -signal.SIGKILL
    assert tokens == want
    assert _tier(llm, name).errors > 0
    # With the tier gone, asks are plain misses.
    llm.reset_prefix_cache()
    tokens, cached = _generate(llm, docs[2:])
    assert tokens == want[2:] and cached == [0]
    assert_no_leak(llm)


def test_frozen_redis_times_out_into_misses(
    redis_server: RedisServer,
    tiered_llm: Callable[..., LLM],
    docs: list[list[int]],
    want: list[list[int]],
) -> None:
    llm = tiered_llm(remote_url=redis_server.url, local_cpu=False, blocking_timeout_secs=0.5)
    assert _generate(llm, docs[:1])[0] == want[:1]
    llm.reset_prefix_cache()
    assert redis_server.proc is not None
    redis_server.proc.send_signal(signal.SIGSTOP)
    try:
        tokens, cached = _generate(llm, docs[:2])
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)
    assert tokens == want[:2] and cached == [0, 0]
    assert _tier(llm, "redis").errors > 0
    assert_no_leak(llm)


def test_corrupt_chunk_on_disk_is_never_served(
    tmp_path: Path, tiered_llm: Callable[..., LLM], docs: list[list[int]], want: list[list[int]]
) -> None:
    disk = tmp_path / "disk"
    llm = tiered_llm(local_disk=str(disk), local_cpu=False)
    assert _generate(llm, docs[:1])[0] == want[:1]
    engine_id = llm.llm_engine.config.kv_transfer_config.engine_id
    CacheEngineBuilder.get(engine_id).flush()
    files = sorted(disk.glob("*" + SUFFIX))
    assert len(files) == CHUNK_TOKENS // 256
    # Flip payload bytes in place (same size: only the checksum can tell).
    with open(files[0], "r+b") as f:
        f.seek(-64, os.SEEK_END)
        tail = f.read(64)
        f.seek(-64, os.SEEK_END)
        f.write(bytes(b ^ 0xFF for b in tail))
    llm.reset_prefix_cache()
    tokens, cached = _generate(llm, docs[:1])
    assert tokens == want[:1]
    # Every chunk of the document was looked up and loaded; the bad one failed its
    # checksum, so the KV from it on was recomputed and the file is gone.
    assert _tier(llm, "disk").errors >= 1, "the corrupt chunk was not detected"
    assert cached[0] < CHUNK_TOKENS
    assert not files[0].exists()
    assert_no_leak(llm)


def test_disk_tier_at_its_file_size_limit_fails_cleanly(
    tmp_path: Path, docs: list[list[int]], want: list[list[int]]
) -> None:
    disk = tmp_path / "disk"
    spec = {
        "extra": {"local_disk": str(disk), "local_cpu": False},
        "doc": docs[0],
        "asks": 2,
        # Below one chunk file (256 tokens of KV, ~11 MiB): every chunk write hits EFBIG.
        "fsize_limit": 4 << 20,
    }
    proc = subprocess.run(
        [sys.executable, "-m", "tests.kvcache.engine_run", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=HANG_LIMIT_S,
        cwd=Path(__file__).parents[2],
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"engine process failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert [a["tokens"] for a in result["asks"]] == [want[0], want[0]]
    assert [a["num_cached_tokens"] for a in result["asks"]] == [0, 0]
    disk_stats = result["tiers"]["disk"]
    # Both asks stored their full chunks (nothing was there), and each write failed.
    assert disk_stats["errors"] == 2 * CHUNK_TOKENS // 256
    assert disk_stats["hits"] == 0 and disk_stats["bytes_stored"] == 0
    assert sorted(p.name for p in disk.iterdir()) == []  # no partial, no temporary file
    assert "File size limit" not in proc.stderr  # SIGXFSZ was ignored, not fatal
