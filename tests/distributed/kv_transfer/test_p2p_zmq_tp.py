"""P2pZmqConnector under tensor parallelism: a producer and a consumer engine at TP=2 (mp
workers) on a tiny random Llama with 2 KV heads, one per rank, over loopback ZMQ.

Each producer rank sends its own KV heads to the consumer's same rank (kv_port + rank);
the consumer computes just the last prompt token and decodes transformers' greedy tokens.
A transfer that never completes on one rank only makes every rank recompute the prompt
(the scheduler hears from rank 0 alone), and params from a producer of another TP size
are refused by name; no KV block leaks on either side.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from kvserve.entrypoints.disagg.launcher import free_port_run
from kvserve.entrypoints.llm import LLM
from kvserve.sampling_params import SamplingParams
from tests.distributed.kv_transfer.helpers import core_of, drain
from tests.entrypoints.test_llm_tiny_models import build_model, hf_greedy
from tests.reference import assert_no_leak

pytestmark = pytest.mark.slow

TP = 2
MAX_TOKENS = 6
RECV_TIMEOUT_S = 3.0
SEND_TIMEOUT_S = 3.0
RANKS = "tests.executor.rpc_functions:p2p_rank_transfers"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    path = tmp_path_factory.mktemp("p2p_tp_llama")
    return str(path), build_model("llama", path)


def _engine(path: str, transfer: dict[str, Any]) -> LLM:
    return LLM(
        path, tensor_parallel_size=TP, distributed_executor_backend="mp", block_size=4,
        max_num_batched_tokens=64, kv_cache_memory=8 << 20, kv_transfer_config=transfer,
    )  # fmt: skip


@pytest.fixture(scope="module")
def engines(tiny: tuple[str, Any]) -> Iterator[tuple[LLM, LLM, int]]:
    port = free_port_run(TP)  # rank r listens at port + r
    producer = _engine(tiny[0], {
        "kv_connector": "P2pZmqConnector", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"send_timeout_s": SEND_TIMEOUT_S},
    })  # fmt: skip
    try:
        consumer = _engine(tiny[0], {
            "kv_connector": "P2pZmqConnector", "kv_role": "kv_consumer",
            "kv_connector_extra_config": {"kv_port": port, "recv_timeout_s": RECV_TIMEOUT_S},
        })  # fmt: skip
        try:
            yield producer, consumer, port
        finally:
            consumer.llm_engine.shutdown()
    finally:
        producer.llm_engine.shutdown()


def _prompt(seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(27)]  # 6 full blocks of 4 and a tail


def _params(max_tokens: int, kv_transfer_params: dict[str, Any]) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
        extra_args={"kv_transfer_params": kv_transfer_params},
    )  # fmt: skip


def _prefill(producer: LLM, ids: list[int], port: int, **extra: Any) -> dict[str, Any]:
    send = {"do_remote_decode": True, "remote_host": "127.0.0.1", "remote_port": port, **extra}
    [out] = producer.generate({"prompt_token_ids": ids}, _params(1, send), use_tqdm=False)
    assert out.kv_transfer_params is not None
    return dict(out.kv_transfer_params)


def _decode(consumer: LLM, ids: list[int], params: dict[str, Any]) -> tuple[list[int], int]:
    [out] = consumer.generate(
        {"prompt_token_ids": ids}, _params(MAX_TOKENS, params), use_tqdm=False
    )
    return list(out.outputs[0].token_ids), out.num_cached_tokens or 0


def _rank_transfers(llm: LLM) -> list[dict[str, int]]:
    return list(core_of(llm).model_executor.collective_rpc(RANKS))


def _consumer_failures(llm: LLM) -> float:
    stats = core_of(llm).scheduler.connector.get_kv_connector_stats() or {}
    return float(stats.get("transfer_requests", {}).get("failed", 0))


def _settle(producer: LLM, consumer: LLM) -> None:
    drain(producer, timeout=SEND_TIMEOUT_S + 20)
    drain(consumer)
    assert_no_leak(producer)
    assert_no_leak(consumer)


def test_every_rank_sends_its_heads_to_the_same_rank(
    engines: tuple[LLM, LLM, int], tiny: tuple[str, Any]
) -> None:
    producer, consumer, port = engines
    vocab = tiny[1].config.vocab_size
    ids = _prompt(1, vocab)
    params = _prefill(producer, ids, port)
    assert params["tp_size"] == TP and params["num_tokens"] == len(ids) - 1
    tokens, cached = _decode(consumer, ids, params)
    assert tokens == hf_greedy(tiny[1], ids, MAX_TOKENS)
    assert cached == len(ids) - 1  # only the last prompt token computed here
    assert _rank_transfers(consumer) == [{"received": 1, "failed": 0, "auth_failures": 0}] * TP
    stats = core_of(consumer).scheduler.connector.get_kv_connector_stats() or {}
    assert stats["transfer_requests"]["received"] == 1
    _settle(producer, consumer)

    # A producer of another TP size: its ranks hold other heads; refused, computed here.
    other = {**_prefill(producer, _prompt(2, vocab), port), "tp_size": 1}
    ids = _prompt(2, vocab)
    tokens, cached = _decode(consumer, ids, other)
    assert tokens == hf_greedy(tiny[1], ids, MAX_TOKENS)
    assert cached == 0
    stats = core_of(consumer).scheduler.connector.get_kv_connector_stats() or {}
    assert stats["transfer_requests"]["refused"] == 1
    _settle(producer, consumer)


def test_a_transfer_lost_on_one_rank_is_recomputed_by_all(
    engines: tuple[LLM, LLM, int], tiny: tuple[str, Any]
) -> None:
    producer, consumer, port = engines
    ids = _prompt(3, tiny[1].config.vocab_size)
    before, failed = _rank_transfers(consumer), _consumer_failures(consumer)
    # Rank 1 sends only its first layer: its consumer rank never completes the transfer.
    params = _prefill(producer, ids, port, fault_stop_after_layers=1, fault_tp_rank=1)
    tokens, cached = _decode(consumer, ids, params)
    assert tokens == hf_greedy(tiny[1], ids, MAX_TOKENS)
    assert cached == 0  # rank 0 had its heads, yet every rank recomputed the prompt
    after = _rank_transfers(consumer)
    assert [a["received"] - b["received"] for a, b in zip(after, before, strict=True)] == [1, 0]
    assert [a["failed"] - b["failed"] for a, b in zip(after, before, strict=True)] == [0, 1]
    assert _consumer_failures(consumer) == failed + 1  # kv_connector_transfer_requests
    _settle(producer, consumer)
