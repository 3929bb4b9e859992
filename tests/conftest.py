"""Session-wide fixtures: the real default model, loaded once, and the HF reference."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from tests.engine_cache import EngineCache, engine_cache

# Gemma 3 270M's engine and HF reference, shared session-wide by the tests that use them.
pytest_plugins = ["tests.gemma3_fixtures"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config: pytest.Config) -> None:
    # kvserve's own cache (converted tokenizers) lives in pytest's cache directory, kept
    # between runs (every later run, and each server process a test starts, skips the
    # conversion) but never in the real home. Tests of the cache use tmp_path instead.
    if getattr(config, "cache", None) is not None:
        os.environ.setdefault("KVSERVE_HOME", str(config.cache.mkdir("kvserve")))


# Small enough that several engines fit in memory side by side during the suite.
TEST_KV_CACHE_MEMORY = 128 << 20


@pytest.fixture(scope="module", autouse=True)
def _release_module_engines() -> Iterator[None]:
    yield
    for cache in EngineCache.live:
        cache.release()


@pytest.fixture(scope="session")
def llm_factory() -> Iterator[EngineCache]:
    """Builds LLM instances for the real default model, one per distinct configuration."""
    yield from engine_cache(kv_cache_memory=TEST_KV_CACHE_MEMORY)


@pytest.fixture(scope="session")
def llm(llm_factory: EngineCache) -> Any:
    """The default engine configuration (prefix caching on, chunked prefill on)."""
    return llm_factory.pin()
