"""The one step loop (engine_core/batch_queue.py): a plain step is a batch queue of depth 1.

On a tiny random Llama (tests/engine_core/builders.py): every step() of a depth-1 core sends
one step and applies it in the same call, the queue is empty between calls, and the
greedy tokens, chunked prefill included, are HF's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvserve.engine_core.core import EngineCore
from tests.engine_core.builders import tiny_engine_core, tiny_llama
from tests.engine_core.test_core_proc import make_request
from tests.entrypoints.test_llm_tiny_models import hf_greedy

PROMPTS = [list(range(5, 29)), list(range(40, 47))]  # 24 tokens: two 16-token chunks
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EngineCore, Any]]:
    directory = tmp_path_factory.mktemp("tiny-llama")
    reference = tiny_llama(directory)
    core = tiny_engine_core(directory)
    yield core, reference
    core.shutdown()


def test_a_plain_step_sends_and_applies_in_one_call(tiny: tuple[EngineCore, Any]) -> None:
    core, reference = tiny
    assert core.batch_queue.size == 1
    for i, prompt in enumerate(PROMPTS):
        core.add_request(make_request(f"r{i}", MAX_TOKENS, prompt))
    tokens: dict[str, list[int]] = {"r0": [], "r1": []}
    finished: set[str] = set()
    steps = 0
    while len(finished) < len(PROMPTS):
        outputs, sent = core.step()
        steps += 1
        assert sent and not core.batch_queue  # applied in the call that sent it
        for output in outputs.outputs:
            tokens[output.request_id] += output.new_token_ids
            if output.finished:
                finished.add(output.request_id)
        assert steps < 50
    for i, prompt in enumerate(PROMPTS):
        assert tokens[f"r{i}"] == hf_greedy(reference, prompt, MAX_TOKENS)
    # A step with nothing to do sends nothing and applies nothing.
    outputs, sent = core.step()
    assert not sent and not outputs.outputs and not core.has_work()
    core.scheduler.check_integrity()
    pool = core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1


def test_the_scheduler_reports_when_requests_first_ran(tiny: tuple[EngineCore, Any]) -> None:
    core, _ = tiny
    core.add_request(make_request("q0", 2, PROMPTS[1]))
    core.add_request(make_request("q1", 2, PROMPTS[1]))
    outputs, _ = core.step()
    assert outputs.scheduled_times is not None and outputs.scheduled_times.keys() == {"q0", "q1"}
    while core.has_work():
        outputs, _ = core.step()
        assert outputs.scheduled_times is None  # reported once


def test_queue_time_is_measured_in_process(tmp_path_factory: pytest.TempPathFactory) -> None:
    from kvserve.entrypoints.llm import LLM
    from kvserve.metrics.reader import Histogram
    from kvserve.sampling_params import SamplingParams

    directory = tmp_path_factory.mktemp("tiny-llama-metrics")
    tiny_llama(directory)
    llm = LLM(
        str(directory),
        block_size=4,
        max_num_batched_tokens=16,
        max_num_seqs=1,  # the second request waits for the first: a real queue time
        kv_cache_memory=8 << 20,
        disable_log_stats=False,
    )
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    histograms = {m.name: m for m in llm.get_metrics() if isinstance(m, Histogram)}
    queue = histograms["kvserve:request_queue_time_seconds"]
    e2e = histograms["kvserve:e2e_request_latency_seconds"]
    assert queue.count == e2e.count == len(PROMPTS)
    assert 0.0 < queue.sum < e2e.sum  # the second request queued; no one queued all along
    llm.llm_engine.shutdown()
