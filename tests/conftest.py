"""Session-wide fixtures: the real default model, loaded once, and the HF reference."""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

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


def engine_cache(**defaults: Any) -> Iterator[Callable[..., Any]]:
    """A session's LLM builder: one engine per distinct configuration (defaults filled in),
    all shut down at the end. Session fixtures yield from it."""
    from kvserve.entrypoints.llm import LLM

    cache: dict[tuple[tuple[str, Any], ...], LLM] = {}

    def make(**kwargs: Any) -> LLM:
        kwargs = {**defaults, **kwargs}
        key = tuple(sorted(kwargs.items()))
        if key not in cache:
            cache[key] = LLM(**kwargs)
        return cache[key]

    yield make
    for llm in cache.values():
        llm.llm_engine.shutdown()
    cache.clear()
    gc.collect()


@pytest.fixture(scope="session")
def llm_factory() -> Iterator[Callable[..., Any]]:
    """Builds LLM instances for the real default model, one per distinct configuration."""
    yield from engine_cache(kv_cache_memory=TEST_KV_CACHE_MEMORY)


@pytest.fixture(scope="session")
def llm(llm_factory: Callable[..., Any]) -> Any:
    """The default engine configuration (prefix caching on, chunked prefill on)."""
    return llm_factory()
