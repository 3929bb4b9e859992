"""AsyncLLM against a real engine-core process (one for the module; the last test kills it)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import pytest
from prometheus_client import CollectorRegistry

from kvserve.args.engine_args import EngineArgs
from kvserve.engine.async_llm import AsyncLLM
from kvserve.engine.exceptions import EngineDeadError
from kvserve.metrics.loggers import PrometheusStatLogger
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import RequestOutputKind, SamplingParams
from tests.conftest import TEST_KV_CACHE_MEMORY

pytestmark = pytest.mark.slow
T = TypeVar("T")
PROMPT = "The capital of France is"


def greedy(max_tokens: int, kind: RequestOutputKind, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, output_kind=kind, **kwargs)


@pytest.fixture(scope="module")
def run() -> Iterator[Callable[[Coroutine[Any, Any, T]], T]]:
    """One event loop for the module: AsyncLLM binds to the loop of its first call."""
    loop = asyncio.new_event_loop()
    yield loop.run_until_complete
    loop.close()


@pytest.fixture(scope="module")
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture(scope="module")
def engine(registry: CollectorRegistry, run: Callable[..., Any]) -> Iterator[AsyncLLM]:
    engine = AsyncLLM.from_engine_args(
        EngineArgs(kv_cache_memory=TEST_KV_CACHE_MEMORY),
        stat_loggers=[PrometheusStatLogger("m", registry)],
    )
    yield engine
    engine.shutdown()


async def stream(
    engine: AsyncLLM, request_id: str, params: SamplingParams, prompt: str = PROMPT
) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, params, request_id)]


async def wait_idle(engine: AsyncLLM, timeout: float) -> float:
    """Seconds until the core reports nothing running or waiting (fails after timeout)."""
    start = time.monotonic()
    while True:
        stats = await engine.get_scheduler_stats()
        elapsed = time.monotonic() - start
        if not stats.num_running_reqs and not stats.num_waiting_reqs:
            return elapsed
        assert elapsed < timeout, f"still busy after {elapsed:.2f}s: {stats}"
        await asyncio.sleep(0.01)


def test_bad_model_path_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="cannot resolve model"):
        AsyncLLM.from_engine_args(EngineArgs(model="/no/such/model.gguf"))


def test_delta_stream_equals_final_and_in_process_engine(
    engine: AsyncLLM, run: Callable[..., Any], llm: Any
) -> None:
    deltas = run(stream(engine, "delta", greedy(5, RequestOutputKind.DELTA)))
    final = run(stream(engine, "final", greedy(5, RequestOutputKind.FINAL_ONLY)))
    assert len(final) == 1 and final[0].finished
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert "".join(d.outputs[0].text for d in deltas) == final[0].outputs[0].text
    tokens = [t for d in deltas for t in d.outputs[0].token_ids]
    assert tokens == final[0].outputs[0].token_ids and len(tokens) == 5
    (reference,) = llm.generate(PROMPT, greedy(5, RequestOutputKind.FINAL_ONLY), use_tqdm=False)
    assert tokens == reference.outputs[0].token_ids


def test_bad_input_raises_before_any_output(engine: AsyncLLM, run: Callable[..., Any]) -> None:
    async def consume() -> None:
        async for _ in engine.generate(
            PROMPT, greedy(2, RequestOutputKind.DELTA), "bad", priority=3
        ):  # fcfs engine: priority is rejected
            pytest.fail("yielded an output for an invalid request")

    with pytest.raises(ValueError, match="priority"):
        run(consume())
    assert not engine.output_processor.has_unfinished_requests()


def test_sixteen_concurrent_requests_and_n2(engine: AsyncLLM, run: Callable[..., Any]) -> None:
    async def many() -> list[list[RequestOutput]]:
        params = greedy(3, RequestOutputKind.DELTA, ignore_eos=True)
        return await asyncio.gather(
            *(stream(engine, f"c{i}", params, prompt=f"Count to {i}:") for i in range(16))
        )

    results = run(many())
    for outputs in results:
        assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "length"
        assert sum(len(o.outputs[0].token_ids) for o in outputs) == 3
    params = greedy(2, RequestOutputKind.FINAL_ONLY, n=2, ignore_eos=True)
    (two,) = run(stream(engine, "pair", params))
    assert [c.index for c in two.outputs] == [0, 1]
    assert all(len(c.token_ids) == 2 for c in two.outputs)
    run(wait_idle(engine, timeout=1.0))


def test_cancelled_consumer_aborts_its_request(engine: AsyncLLM, run: Callable[..., Any]) -> None:
    async def scenario() -> float:
        first = asyncio.Event()

        async def consume() -> None:
            params = greedy(10_000, RequestOutputKind.DELTA, ignore_eos=True)
            async for _ in engine.generate(PROMPT, params, "cancel-me"):
                first.set()

        task = asyncio.create_task(consume())
        await first.wait()
        assert (await engine.get_scheduler_stats()).num_running_reqs == 1
        task.cancel()  # what the server sees when an HTTP client disconnects
        with pytest.raises(asyncio.CancelledError):
            await task
        return await wait_idle(engine, timeout=1.0)

    run(scenario())
    assert not engine.output_processor.has_unfinished_requests()
    assert run(engine.get_scheduler_stats()).kv_cache_usage == 0.0


def test_external_abort_ends_the_stream(engine: AsyncLLM, run: Callable[..., Any]) -> None:
    async def scenario() -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        params = greedy(10_000, RequestOutputKind.DELTA, ignore_eos=True)
        async for out in engine.generate(PROMPT, params, "abort-me"):
            outputs.append(out)
            if len(outputs) == 1:
                await engine.abort("abort-me")
        await wait_idle(engine, timeout=1.0)
        return outputs

    outputs = run(scenario())
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"


def test_metrics_count_one_request_exactly(
    engine: AsyncLLM, run: Callable[..., Any], registry: CollectorRegistry
) -> None:
    def sample(name: str, **labels: str) -> float:
        return (
            registry.get_sample_value(
                "kvserve:" + name, {"model_name": "m", "engine": "0", **labels}
            )
            or 0.0
        )

    names = [
        "prompt_tokens_total",
        "generation_tokens_total",
        "time_to_first_token_seconds_count",
        "inter_token_latency_seconds_count",
        "e2e_request_latency_seconds_count",
        "request_queue_time_seconds_count",
    ]
    before = {n: sample(n) for n in names}
    length_before = sample("request_success_total", finished_reason="length")
    (out,) = run(
        stream(engine, "metered", greedy(4, RequestOutputKind.FINAL_ONLY, ignore_eos=True))
    )
    run(wait_idle(engine, timeout=1.0))
    delta = {n: sample(n) - before[n] for n in names}
    assert delta == {
        "prompt_tokens_total": len(out.prompt_token_ids or []),
        "generation_tokens_total": 4,
        "time_to_first_token_seconds_count": 1,
        "inter_token_latency_seconds_count": 3,
        "e2e_request_latency_seconds_count": 1,
        "request_queue_time_seconds_count": 1,
    }
    assert sample("request_success_total", finished_reason="length") == length_before + 1
    assert sample("num_requests_running") == 0 and sample("kv_cache_usage_perc") == 0.0


def test_engine_death_fails_generate_and_health(engine: AsyncLLM, run: Callable[..., Any]) -> None:
    """Runs last: it kills the module's engine-core process."""

    async def scenario() -> float:
        await engine.check_health()  # healthy before the kill
        first = asyncio.Event()

        async def consume() -> None:
            params = greedy(10_000, RequestOutputKind.DELTA, ignore_eos=True)
            async for _ in engine.generate(PROMPT, params, "doomed"):
                first.set()

        task = asyncio.create_task(consume())
        await first.wait()
        assert engine.engine_core.proc.pid is not None
        os.kill(engine.engine_core.proc.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(task, timeout=5)
        elapsed = time.monotonic() - start
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        with pytest.raises(EngineDeadError):
            await stream(engine, "after-death", greedy(2, RequestOutputKind.DELTA))
        return elapsed

    assert run(scenario()) < 3.0
    assert engine.errored and not engine.is_running
