"""ZmqEventPublisher on real sockets, without a model."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from msgspec.structs import replace

from kvserve.config import KVEventsConfig
from kvserve.distributed.kv_events_publisher import (
    END_SEQ,
    EventPublisherFactory,
    NullEventPublisher,
    ZmqEventPublisher,
)
from kvserve.distributed.kv_events_subscriber import KVEventSubscriber, decode_batch
from kvserve.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from kvserve.utils.zmq_curve import SocketSecurity, socket_security
from tests.distributed.kv_events_helpers import SECURITY, free_port, recv_batch, wait_subscribed


def stored(i: int) -> BlockStored:
    return BlockStored(
        block_hashes=[bytes([i]) * 32],
        parent_block_hash=None if i == 0 else bytes([i - 1]) * 32,
        token_ids=list(range(i * 4, i * 4 + 4)),
        block_size=4,
        medium="GPU",
    )


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def subscribe(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, topic: bytes = b""
) -> zmq.Socket[bytes]:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    SECURITY.curve_client(sub)
    sub.connect(endpoint)
    return sub


def test_messages_are_topic_seq_payload_with_contiguous_seq(ctx: zmq.Context) -> None:
    publisher = ZmqEventPublisher("tcp://127.0.0.1:*", topic="kv", security=SECURITY)
    try:
        sub = subscribe(ctx, publisher.endpoint, b"kv")
        other = subscribe(ctx, publisher.endpoint, b"other-topic")
        last = wait_subscribed(publisher, sub)
        sent = [
            KVEventBatch(ts=1.0, events=[stored(0), stored(1)]),
            KVEventBatch(ts=2.0, events=[BlockRemoved(block_hashes=[bytes([0]) * 32])]),
            KVEventBatch(ts=3.0, events=[AllBlocksCleared()]),
        ]
        for batch in sent:
            publisher.publish(batch)
        received = [recv_batch(sub) for _ in sent]
        assert [topic for topic, _, _ in received] == [b"kv"] * 3
        assert [seq for _, seq, _ in received] == [last + 1, last + 2, last + 3]
        assert [batch for _, _, batch in received] == sent
        assert not other.poll(200), "a subscriber of another topic got messages"
    finally:
        publisher.shutdown()


def test_replay_resends_buffered_batches_from_the_requested_seq(ctx: zmq.Context) -> None:
    publisher = ZmqEventPublisher(
        "tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", buffer_steps=4, security=SECURITY
    )
    try:
        # Nobody subscribed: the PUB socket drops these, the ring buffer keeps the last 4.
        for i in range(6):
            publisher.publish(KVEventBatch(ts=float(i), events=[stored(i)]))
        dealer = ctx.socket(zmq.DEALER)
        SECURITY.curve_client(dealer)
        dealer.connect(publisher.replay_endpoint or "")

        def replay(start: int) -> list[tuple[int, float]]:
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            got: list[tuple[int, float]] = []
            while True:
                assert dealer.poll(5000), "no replay answer"
                empty, seq, payload = dealer.recv_multipart()
                assert empty == b""
                if seq == END_SEQ:
                    assert payload == b""
                    return got
                got.append((int.from_bytes(seq, "big"), decode_batch(payload).ts))

        deadline = time.monotonic() + 5
        while replay(0) != [(s, float(s)) for s in range(2, 6)]:  # the thread may still drain
            assert time.monotonic() < deadline
        assert replay(4) == [(4, 4.0), (5, 5.0)]
        assert replay(100) == []
        # The library's own client decodes the same answers.
        with KVEventSubscriber(
            publisher.endpoint, publisher.replay_endpoint, security=SECURITY
        ) as client:
            batches = list(client.replay(3))
        assert [seq for seq, _ in batches] == [3, 4, 5]
        assert [b.events for _, b in batches] == [[stored(3)], [stored(4)], [stored(5)]]
    finally:
        publisher.shutdown()


def test_replay_of_a_large_buffer_to_a_slow_client_loses_nothing(ctx: zmq.Context) -> None:
    # More batches than ZMQ's default high-water mark (1000), larger than the TCP buffers,
    # to a client that reads only after the whole answer was sent.
    publisher = ZmqEventPublisher(
        "tcp://127.0.0.1:*",
        replay_endpoint="tcp://127.0.0.1:*",
        buffer_steps=5000,
        security=SECURITY,
    )
    try:
        for i in range(3000):
            batch = KVEventBatch(
                ts=float(i), events=[replace(stored(i % 200), token_ids=[i] * 1024)]
            )
            publisher.publish(batch)
        dealer = ctx.socket(zmq.DEALER)
        SECURITY.curve_client(dealer)
        dealer.connect(publisher.replay_endpoint or "")
        with KVEventSubscriber(
            publisher.endpoint, publisher.replay_endpoint, security=SECURITY
        ) as probe:
            deadline = time.monotonic() + 10
            while not list(probe.replay(2999)):  # until the thread has buffered everything
                assert time.monotonic() < deadline
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        time.sleep(1.5)
        seqs: list[int] = []
        while True:
            assert dealer.poll(5000), f"answer stopped after {len(seqs)} batches"
            _, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                break
            seqs.append(int.from_bytes(seq, "big"))
            assert decode_batch(payload).events[0].token_ids[0] == seqs[-1]
        assert seqs == list(range(3000))
    finally:
        publisher.shutdown()


def test_full_queue_drops_without_blocking_and_leaves_a_seq_gap() -> None:
    publisher = ZmqEventPublisher(
        "tcp://127.0.0.1:*",
        replay_endpoint="tcp://127.0.0.1:*",
        max_queue_size=2,
        security=SECURITY,
    )
    old_interval = sys.getswitchinterval()
    # Keep the publisher thread off the GIL while we publish, so the queue really fills.
    sys.setswitchinterval(5.0)
    try:
        start = time.perf_counter()
        for i in range(50):
            publisher.publish(KVEventBatch(ts=float(i), events=[]))
        elapsed = time.perf_counter() - start
    finally:
        sys.setswitchinterval(old_interval)
    try:
        assert elapsed < 1.0, "publish() blocked on a full queue"
        assert publisher.num_dropped >= 48 - 2  # the thread may have taken a couple
        kept = 50 - publisher.num_dropped
        with KVEventSubscriber(
            publisher.endpoint, publisher.replay_endpoint, security=SECURITY
        ) as client:

            def replay_until(count: int) -> list[int]:
                deadline = time.monotonic() + 5
                while len(seqs := [s for s, _ in client.replay(0)]) < count:
                    assert time.monotonic() < deadline, seqs
                return seqs

            replay_until(kept)  # the queue has drained
            # The next batch is numbered after the dropped ones.
            publisher.publish(KVEventBatch(ts=50.0, events=[]))
            seqs = replay_until(kept + 1)
        # Kept batches keep the numbers they were given, so the dropped ones are visible
        # gaps (which ones were dropped depends on when the thread ran), and the next
        # batch is numbered after every dropped one.
        assert len(seqs) == kept + 1 and seqs[-1] == 50
        assert seqs[:-1] == sorted(set(seqs[:-1])) and all(0 <= s < 50 for s in seqs[:-1])
    finally:
        publisher.shutdown()


def test_shutdown_delivers_queued_batches_and_joins_the_thread(ctx: zmq.Context) -> None:
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    publisher = ZmqEventPublisher(endpoint, security=SECURITY)
    sub = subscribe(ctx, endpoint)
    last = wait_subscribed(publisher, sub)
    for i in range(100):
        publisher.publish(KVEventBatch(ts=float(i), events=[stored(i % 8)]))
    publisher.shutdown()
    # Its own thread is gone (other tests' engines may still run publishers of their own).
    assert not publisher._thread.is_alive()
    seqs = [recv_batch(sub)[1] for _ in range(100)]
    assert seqs == list(range(last + 1, last + 101))
    with pytest.raises(RuntimeError, match="closed"):
        publisher.publish(KVEventBatch(ts=0.0, events=[]))
    publisher.shutdown()  # idempotent
    # The port is free again.
    ZmqEventPublisher(endpoint, security=SECURITY).shutdown()


def test_a_busy_port_fails_in_the_constructor() -> None:
    first = ZmqEventPublisher("tcp://127.0.0.1:*", security=SECURITY)
    try:
        threads = threading.active_count()
        with pytest.raises(RuntimeError, match="cannot bind"):
            ZmqEventPublisher(first.endpoint, security=SECURITY)
        assert threading.active_count() == threads
    finally:
        first.shutdown()


def test_factory_builds_the_configured_publisher() -> None:
    assert isinstance(EventPublisherFactory.create(None), NullEventPublisher)
    assert isinstance(EventPublisherFactory.create(KVEventsConfig()), NullEventPublisher)
    off = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    assert isinstance(EventPublisherFactory.create(off), NullEventPublisher)
    port = free_port()
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{port - 1}")
    assert config.publisher == "zmq"
    # Data-parallel rank r publishes on the configured port + r.
    publisher = EventPublisherFactory.create(config, data_parallel_rank=1)
    try:
        assert isinstance(publisher, ZmqEventPublisher)
        assert publisher.endpoint == f"tcp://127.0.0.1:{port}"
    finally:
        publisher.shutdown()


def test_a_subscriber_without_the_secret_receives_nothing_and_is_logged(
    ctx: zmq.Context, caplog: pytest.LogCaptureFixture
) -> None:
    """CURVE refuses a subscriber with another secret, and a plaintext one, in the
    handshake: the publisher logs the refusal, and a subscriber with the secret still
    gets every batch."""
    stranger = socket_security(b"another-operators-kv-secret-0123")
    publisher = ZmqEventPublisher(
        "tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", security=SECURITY
    )
    try:
        with caplog.at_level(logging.WARNING, logger="kvserve.utils.zmq_curve"):
            with KVEventSubscriber(publisher.endpoint, security=stranger) as wrong:
                plain = ctx.socket(zmq.SUB)
                plain.setsockopt(zmq.SUBSCRIBE, b"")
                plain.connect(publisher.endpoint)
                good = subscribe(ctx, publisher.endpoint)
                last = wait_subscribed(publisher, good)
                publisher.publish(KVEventBatch(ts=1.0, events=[stored(0)]))
                assert recv_batch(good)[1:] == (last + 1, KVEventBatch(ts=1.0, events=[stored(0)]))
                assert wrong.recv(timeout=0.3) is None
                assert not plain.poll(0)
                with pytest.raises(TimeoutError):
                    list(wrong_replay(publisher, stranger))
        refusals = [
            r.getMessage() for r in caplog.records if "refused a ZMQ peer" in r.getMessage()
        ]
        assert refusals and "KV secret" in refusals[0]
        # Once per endpoint, however often the strangers reconnect.
        assert len(refusals) == len(set(refusals)) <= 2  # the PUB and the replay socket
    finally:
        publisher.shutdown()


def wrong_replay(publisher: ZmqEventPublisher, security: SocketSecurity) -> Iterator[Any]:
    with KVEventSubscriber(publisher.endpoint, publisher.replay_endpoint, security=security) as c:
        yield from c.replay(0, timeout=0.3)
