"""P2pZmqConnector between two real engines in this process (a producer and a consumer on
loopback ZMQ), driven step by step so the block pools can be checked at every point.

The consumer's request waits in WAITING_FOR_REMOTE_KVS, then computes only the last
prompt token and decodes HF's greedy tokens; the producer holds the request's blocks
until its transfer ended; an abort while the KV is on the way, KV for other tokens, and a
transfer that never completes leak no block.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

import pytest

from kvserve.core.request import RequestStatus
from tests.distributed.kv_transfer.helpers import (
    GREEDY,
    as_json,
    core_of,
    drain,
    prompt_ids,
    run_by_hand,
    with_params,
)
from tests.reference import assert_no_leak, hf_reference

pytestmark = pytest.mark.slow

RECV_TIMEOUT_S = 2.0
SEND_TIMEOUT_S = 2.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def kv_port() -> int:
    return _free_port()


@pytest.fixture(scope="module")
def producer(llm_factory: Callable[..., Any]) -> Any:
    config = {
        "kv_connector": "P2pZmqConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"send_timeout_s": SEND_TIMEOUT_S},
    }
    return llm_factory(kv_transfer_config=as_json(config))


@pytest.fixture(scope="module")
def consumer(llm_factory: Callable[..., Any], kv_port: int) -> Any:
    config = {
        "kv_connector": "P2pZmqConnector",
        "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"kv_port": kv_port, "recv_timeout_s": RECV_TIMEOUT_S},
    }
    return llm_factory(kv_transfer_config=as_json(config))


def _prefill(producer: Any, ids: list[int], port: int, **extra: Any) -> dict[str, Any]:
    send = {"do_remote_decode": True, "remote_host": "127.0.0.1", "remote_port": port, **extra}
    params = GREEDY.clone(max_tokens=1, extra_args={"kv_transfer_params": send})
    [out] = producer.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    assert out.kv_transfer_params is not None
    return dict(out.kv_transfer_params)


def _transfers(llm: Any) -> dict[str, float]:
    """The connector's transfer_requests totals by kind (received, failed, sent)."""
    stats = core_of(llm).scheduler.connector.get_kv_connector_stats() or {}
    return dict(stats.get("transfer_requests", {}))


def _free_blocks(llm: Any) -> int:
    return int(core_of(llm).scheduler.kv_cache_manager.block_pool.get_num_free_blocks())


def test_consumer_loads_the_prompt_and_computes_one_token(
    producer: Any, consumer: Any, kv_port: int
) -> None:
    ids = prompt_ids(consumer.get_tokenizer(), "transfers")  # 53 tokens
    params = _prefill(producer, ids, kv_port)
    assert params["num_tokens"] == 52 and params["do_remote_prefill"]
    statuses: list[RequestStatus] = []
    scheduler = core_of(consumer).scheduler
    original = scheduler.schedule

    def watching_schedule() -> Any:
        output = original()
        statuses.extend(r.status for r in scheduler.waiting)
        return output

    scheduler.schedule = watching_schedule
    try:
        scheduled, tokens, final = run_by_hand(consumer, "p2p-1", ids, with_params(params))
    finally:
        del scheduler.schedule
    assert RequestStatus.WAITING_FOR_REMOTE_KVS in statuses
    assert [n for n in scheduled if n] == [1] * GREEDY.max_tokens  # the last token, decodes
    assert tokens == hf_reference().greedy(ids, GREEDY.max_tokens)
    assert final.num_cached_tokens == 52
    drain(producer)
    assert_no_leak(producer)
    assert_no_leak(consumer)


def test_n_samples_share_one_transfer(producer: Any, consumer: Any, kv_port: int) -> None:
    ids = prompt_ids(consumer.get_tokenizer(), "many samples")
    params = _prefill(producer, ids, kv_port)
    before = _transfers(consumer)
    [out] = consumer.generate(
        {"prompt_token_ids": ids}, with_params(params).clone(n=2), use_tqdm=False
    )
    # One sample loads the KV; the other computes the prompt rather than wait for it.
    after = _transfers(consumer)
    assert after.get("received", 0) == before.get("received", 0) + 1
    assert after.get("failed", 0) == before.get("failed", 0)
    expected = hf_reference().greedy(ids, GREEDY.max_tokens)
    assert [c.token_ids for c in out.outputs] == [expected, expected]
    drain(producer)
    assert_no_leak(consumer)


def test_producer_holds_its_blocks_until_the_transfer_ends(producer: Any) -> None:
    ids = prompt_ids(producer.get_tokenizer(), "nobody listens")
    assert producer.reset_prefix_cache()
    idle = _free_blocks(producer)
    started = time.monotonic()
    _prefill(producer, ids, _free_port())  # no consumer there: never acknowledged
    assert _free_blocks(producer) < idle  # finished, yet its blocks are held
    drain(producer, timeout=SEND_TIMEOUT_S + 10)
    assert time.monotonic() - started >= SEND_TIMEOUT_S
    assert_no_leak(producer)


def test_abort_while_the_kv_is_on_the_way(producer: Any, consumer: Any, kv_port: int) -> None:
    ids = prompt_ids(consumer.get_tokenizer(), "aborted loads")
    params = _prefill(producer, ids, kv_port, fault_stop_after_layers=2)  # never completes
    core = core_of(consumer)
    request, _ = consumer.llm_engine.input_processor.process_inputs(
        "p2p-abort", {"prompt_token_ids": ids}, with_params(params)
    )
    core.add_request(request)
    for _ in range(3):
        core.step()
    assert core.scheduler.requests["p2p-abort"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert _free_blocks(consumer) < core.kv_cache_config.num_blocks - 1
    core.abort_requests(["p2p-abort"])
    drain(consumer)
    drain(producer, timeout=SEND_TIMEOUT_S + 10)
    assert_no_leak(consumer)
    assert_no_leak(producer)


@pytest.mark.parametrize("fault", ["other_tokens", "never_completes"])
def test_bad_transfers_are_recomputed(
    producer: Any, consumer: Any, kv_port: int, fault: str
) -> None:
    ids = prompt_ids(consumer.get_tokenizer(), f"faults {fault}")
    if fault == "other_tokens":  # another prompt's transfer, as long as this one
        params = _prefill(producer, prompt_ids(consumer.get_tokenizer(), "elsewhere"), kv_port)
    else:
        params = _prefill(producer, ids, kv_port, fault_stop_after_layers=5)
    started = time.monotonic()
    scheduled, tokens, _ = run_by_hand(
        consumer, f"p2p-{fault}", ids, with_params(params), timeout=RECV_TIMEOUT_S + 30
    )
    assert tokens == hf_reference().greedy(ids, GREEDY.max_tokens)
    assert sum(scheduled) == len(ids) + GREEDY.max_tokens - 1  # the whole prompt computed
    if fault == "never_completes":
        assert time.monotonic() - started >= RECV_TIMEOUT_S
    drain(producer, timeout=SEND_TIMEOUT_S + 10)
    assert_no_leak(consumer)
    assert_no_leak(producer)
