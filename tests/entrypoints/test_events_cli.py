"""`kvserve events` as a real subprocess against a real publisher."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from kvserve.distributed.kv_events_publisher import ZmqEventPublisher
from kvserve.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)
from tests.distributed.kv_events_helpers import SECURITY

EVENTS_CLI = [sys.executable, "-m", "kvserve.entrypoints.events_cli"]


def event(i: int) -> KVEvent:
    if i % 3 == 0:
        return BlockStored(
            block_hashes=[bytes([i]) * 32, bytes([i + 1]) * 32],
            parent_block_hash=None if i == 0 else bytes([i - 1]) * 32,
            token_ids=[i, i + 1, i + 2, i + 3],
            block_size=2,
            medium="GPU",
        )
    if i % 3 == 1:
        return BlockRemoved(block_hashes=[bytes([i]) * 32], medium="GPU")
    return AllBlocksCleared()


def test_prints_replayed_then_live_events_as_json_lines() -> None:
    publisher = ZmqEventPublisher(
        "tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", topic="kv", security=SECURITY
    )
    try:
        # Published before the CLI starts: only the replay can deliver these.
        for i in range(3):
            publisher.publish(KVEventBatch(ts=100.0 + i, events=[event(i)]))
        proc = subprocess.Popen(
            [
                *EVENTS_CLI,
                publisher.endpoint,
                "--replay",
                publisher.replay_endpoint or "",
                "--from-seq",
                "1",
                "--topic",
                "kv",
                "--count",
                "4",
                "--timeout",
                "30",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        # Then a live stream, until the CLI has seen enough and exits.
        i = 3
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            publisher.publish(KVEventBatch(ts=100.0 + i, events=[event(i)]))
            i += 1
            time.sleep(0.1)
        stdout, stderr = proc.communicate(timeout=10)
    finally:
        publisher.shutdown()
    assert proc.returncode == 0, stderr
    lines = [json.loads(line) for line in stdout.splitlines()]
    assert len(lines) == 4
    assert lines[0] == {
        "seq": 1,
        "ts": 101.0,
        "type": "BlockRemoved",
        "block_hashes": [(bytes([1]) * 32).hex()],
        "medium": "GPU",
        "group_id": None,  # the KV cache group; none given for this event
    }
    assert lines[1] == {"seq": 2, "ts": 102.0, "type": "AllBlocksCleared"}
    # Live batches: each line is the event published with that seq, none printed twice.
    live_seqs = [line["seq"] for line in lines[2:]]
    assert live_seqs == sorted(set(live_seqs)) and live_seqs[0] >= 3
    for line in lines[2:]:
        seq = line["seq"]
        assert line["ts"] == 100.0 + seq
        expected = event(seq)
        assert line["type"] == type(expected).__name__
        if isinstance(expected, BlockStored):
            assert line["block_hashes"] == [h.hex() for h in expected.block_hashes]
            assert line["parent_block_hash"] == (bytes([seq - 1]) * 32).hex()
            assert line["token_ids"] == expected.token_ids
            assert line["block_size"] == 2


def test_times_out_with_an_error_when_the_count_is_not_met() -> None:
    publisher = ZmqEventPublisher("tcp://127.0.0.1:*", security=SECURITY)
    try:
        result = subprocess.run(
            [*EVENTS_CLI, publisher.endpoint, "--count", "1", "--timeout", "0.5"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        publisher.shutdown()
    assert result.returncode == 1
    assert result.stdout == ""
    assert "timed out after 0 of 1 events" in result.stderr
