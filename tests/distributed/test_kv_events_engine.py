"""The real engine publishes its prefix cache's life over ZMQ: stored, evicted, cleared."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq

from kvserve.config import KVEventsConfig
from kvserve.core.kv_cache_utils import get_request_block_hasher
from kvserve.core.request import Request
from kvserve.distributed.kv_events_subscriber import KVEventSubscriber
from kvserve.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
)
from kvserve.sampling_params import SamplingParams
from tests.distributed.kv_events_helpers import (
    PROBE_TS,
    SECURITY,
    free_port,
    recv_batch,
    wait_subscribed,
)
from tests.reference import assert_no_leak

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
# 7 usable blocks (112 tokens): serving prompt B must evict everything prompt A cached.
NUM_BLOCKS = 8
PROMPT_A = list(range(1000, 1050))  # 3 full blocks + 2 tokens
PROMPT_B = list(range(2000, 2100))  # 6 full blocks + 4 tokens
# Few enough output tokens that no further block fills: the stored blocks are the prompt's.
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def engine_block_hashes(prompt: list[int]) -> list[bytes]:
    """What the engine's Request.block_hashes hold for this prompt (default seed 0)."""
    hasher = get_request_block_hasher(BLOCK_SIZE, seed=0)
    return list(Request("x", prompt, GREEDY, None, block_hasher=hasher).block_hashes)


@pytest.fixture
def sub() -> Iterator[zmq.Socket[bytes]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    socket = ctx.socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, b"kvserve")
    SECURITY.curve_client(socket)
    yield socket
    ctx.destroy(linger=0)


def receive_until(
    sub: zmq.Socket[bytes],
    received: list[tuple[int, KVEventBatch]],
    done: Callable[[list[KVCacheEvent]], bool],
) -> list[KVCacheEvent]:
    """Receives batches (appending to received) until done(events of this phase)."""
    events: list[KVCacheEvent] = []
    while not done(events):
        topic, seq, batch = recv_batch(sub, timeout=10)
        assert topic == b"kvserve"
        received.append((seq, batch))
        events.extend(batch.events)
    return events


def test_subscriber_sees_stored_removed_cleared_and_replay_fills_the_gap(
    llm_factory: Callable[..., Any], sub: zmq.Socket[bytes]
) -> None:
    pub_port, replay_port = free_port(), free_port()
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"tcp://127.0.0.1:{pub_port}",
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        topic="kvserve",
    )
    llm = llm_factory(
        kv_events_config=config, num_blocks_override=NUM_BLOCKS, block_size=BLOCK_SIZE
    )
    sub.connect(config.endpoint)
    publisher = llm.llm_engine.engine_core.engine_core.kv_event_publisher
    first_seq = wait_subscribed(publisher, sub) + 1
    received: list[tuple[int, KVEventBatch]] = []
    hashes_a, hashes_b = engine_block_hashes(PROMPT_A), engine_block_hashes(PROMPT_B)
    assert len(hashes_a) == 3 and len(hashes_b) == 6

    llm.generate([{"prompt_token_ids": PROMPT_A}], GREEDY, use_tqdm=False)
    events = receive_until(sub, received, lambda ev: len(ev) >= 1)
    assert events == [
        BlockStored(
            block_hashes=hashes_a,
            parent_block_hash=None,
            token_ids=PROMPT_A[: 3 * BLOCK_SIZE],
            block_size=BLOCK_SIZE,
            medium="GPU",
            group_id=0,
        )
    ]

    # B needs all 7 blocks: A's cached blocks are reused, so their entries are evicted.
    llm.generate([{"prompt_token_ids": PROMPT_B}], GREEDY, use_tqdm=False)
    events = receive_until(sub, received, lambda ev: any(isinstance(e, BlockStored) for e in ev))
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(hashes_a)
    assert all(e.medium == "GPU" for e in removed)
    assert events[len(removed) :] == [
        BlockStored(
            block_hashes=hashes_b,
            parent_block_hash=None,
            token_ids=PROMPT_B[: 6 * BLOCK_SIZE],
            block_size=BLOCK_SIZE,
            medium="GPU",
            group_id=0,
        )
    ]

    assert llm.reset_prefix_cache()
    events = receive_until(sub, received, lambda ev: len(ev) >= 1)
    assert events == [AllBlocksCleared()]
    assert not sub.poll(300), "an unexpected extra batch"

    seqs = [seq for seq, _ in received]
    assert seqs == list(range(first_seq, first_seq + len(seqs)))
    assert all(batch.ts > 0 for _, batch in received)

    # A subscriber that joins now missed everything: the replay socket resends it all.
    with KVEventSubscriber(
        config.endpoint, config.replay_endpoint, "kvserve", security=SECURITY
    ) as late:
        replayed = list(late.replay(0))
    assert [seq for seq, _ in replayed] == list(range(seqs[-1] + 1))
    assert all(batch.ts == PROBE_TS for seq, batch in replayed if seq < first_seq)
    assert replayed[first_seq:] == received
    assert_no_leak(llm)


def test_engine_core_process_publishes_too(llm_factory: Callable[..., Any]) -> None:
    """With the core in its own process the publisher lives there; nothing else changes."""
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"tcp://127.0.0.1:{free_port()}",
        replay_endpoint=f"tcp://127.0.0.1:{free_port()}",
        topic="kvserve",
    )
    llm = llm_factory(kv_events_config=config, multiprocess_mode=True)
    llm.generate([{"prompt_token_ids": PROMPT_A}], GREEDY, use_tqdm=False)
    # Nobody was subscribed while it ran: the replay socket has the batch all the same.
    with KVEventSubscriber(
        config.endpoint, config.replay_endpoint, "kvserve", security=SECURITY
    ) as late:
        replayed = list(late.replay(0))
    assert [seq for seq, _ in replayed] == [0]
    assert replayed[0][1].events == [
        BlockStored(
            block_hashes=engine_block_hashes(PROMPT_A),
            parent_block_hash=None,
            token_ids=PROMPT_A[: 3 * BLOCK_SIZE],
            block_size=BLOCK_SIZE,
            medium="GPU",
            group_id=0,
        )
    ]
