"""LLM.sleep / wake_up (vLLM's sleep mode): the engine core's resident memory drops by the
KV cache at level 1 and by the weights too at level 2, requests are refused while it
sleeps, and after waking the same greedy tokens come out."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from kvserve.engine.exceptions import EngineBusyError, EngineSleepingError
from kvserve.entrypoints.llm import LLM
from kvserve.sampling_params import SamplingParams

KV_CACHE_BYTES = 32 << 20  # 704 tokens (44 blocks) of SmolLM2-135M's float32 KV
MiB = 1 << 20
GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def sleepy_llm() -> Iterator[LLM]:
    """Its own engine (a sleep frees the memory every other test's engine would need),
    with the core in its own process, whose RSS is measured. The core's idle heap trims
    are off, so that nothing but a sleep moves its RSS between two readings."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVSERVE_MALLOC_TRIM_INTERVAL", "0")
        llm = LLM(multiprocess_mode=True, enable_sleep_mode=True, kv_cache_memory=KV_CACHE_BYTES)
    try:
        yield llm
    finally:
        llm.llm_engine.shutdown()


def core_rss(llm: LLM) -> int:
    core: Any = llm.llm_engine.engine_core
    return int(psutil.Process(core.proc.pid).memory_info().rss)


def greedy_tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def fill_kv_cache(llm: LLM) -> None:
    """Four prompts of 150 tokens, sharing no block: 40 blocks of the cache's 44, so
    that its pages are all resident."""
    prompts: list[Any] = [
        {"prompt_token_ids": [1000 + 151 * k + i for i in range(150)]} for k in range(4)
    ]
    llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)


def test_sleep_level_1_frees_the_kv_cache_and_wakes_with_the_same_tokens(sleepy_llm: LLM) -> None:
    llm = sleepy_llm
    before = greedy_tokens(llm)
    fill_kv_cache(llm)
    awake = core_rss(llm)
    llm.sleep(level=1)
    assert llm.is_sleeping()
    freed = awake - core_rss(llm)
    assert freed >= 0.6 * KV_CACHE_BYTES, f"{freed / MiB:.1f} MiB freed"
    with pytest.raises(EngineSleepingError):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.wake_up()
    assert not llm.is_sleeping()
    assert greedy_tokens(llm) == before


def test_sleep_level_2_frees_the_weights_too_and_reloads_them(sleepy_llm: LLM) -> None:
    llm = sleepy_llm
    before = greedy_tokens(llm)
    fill_kv_cache(llm)
    awake = core_rss(llm)
    llm.sleep(level=2)
    freed = awake - core_rss(llm)
    # SmolLM2-135M's weights: ~90 MB of Q4_1 blocks and the tied head's 30 MB of Q8_0
    # blocks, from which the embedding looks its rows up (no float32 table).
    assert freed >= 0.6 * KV_CACHE_BYTES + 90 * MiB, f"{freed / MiB:.1f} MiB freed"
    # Waking the KV cache alone leaves the model asleep: no weights to run.
    llm.wake_up(tags=["kv_cache"])
    assert llm.is_sleeping()
    llm.wake_up(tags=["weights"])
    assert not llm.is_sleeping()
    assert greedy_tokens(llm) == before


def test_sleep_refuses_bad_levels_tags_and_a_busy_engine(sleepy_llm: LLM) -> None:
    llm = sleepy_llm
    with pytest.raises(ValueError, match="level"):
        llm.sleep(level=3)
    with pytest.raises(ValueError, match="tags"):
        llm.wake_up(tags=["activations"])
    engine = llm.llm_engine
    engine.add_request("busy", PROMPTS[0], GREEDY)
    with pytest.raises(EngineBusyError):
        llm.sleep()
    engine.abort_request("busy")
    assert not llm.is_sleeping()


def test_sleep_needs_enable_sleep_mode(llm: LLM) -> None:
    # The shared engine: refused before the engine is touched.
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        llm.sleep()
