"""ProcessorCache: the front end's cache and the engine core's mirror agree step for step
(over msgpack, as on the socket), under eviction, repeats within a request and items too
large to cache, so a hit always travels as its hash alone and is found on the other side."""

from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest

from kvserve.multimodal.processor_cache import ProcessorCache
from kvserve.protocol.mm_inputs import MultiModalFeatureSpec, PlaceholderRange, TensorData


def _feature(mm_hash: str, nbytes: int) -> MultiModalFeatureSpec:
    data = np.full(nbytes // 4, int(mm_hash[1:]), dtype=np.float32)
    return MultiModalFeatureSpec(
        "image", mm_hash, PlaceholderRange(0, 4), {"pixel_values": TensorData.from_array(data)}
    )


def test_sender_and_receiver_stay_in_step() -> None:
    rng = random.Random(0)
    items = {f"h{i}": _feature(f"h{i}", rng.choice([400, 800, 1600, 5000])) for i in range(12)}
    sender, receiver = ProcessorCache(4000), ProcessorCache(4000)
    wire = msgspec.msgpack.Encoder()
    decode = msgspec.msgpack.Decoder(list[MultiModalFeatureSpec]).decode
    sent_without_data = 0
    for _ in range(300):
        request = [items[f"h{rng.randrange(12)}"] for _ in range(rng.randint(1, 3))]
        sent = sender.commit(request)
        sent_without_data += sum(f.data is None for f in sent)
        received = receiver.receive(decode(wire.encode(sent)))
        assert [f.data for f in received] == [f.data for f in request]
        assert list(sender._items) == list(receiver._items)  # same entries, same order
        assert sender.nbytes == receiver.nbytes <= 4000
    assert sent_without_data > 50  # hits did happen, and crossed as their hash alone
    assert (sender.hits, sender.queries) == (receiver.hits, receiver.queries)
    # A 5000-byte item never fits: it always travels with its data.
    assert all(data["pixel_values"].nbytes < 5000 for data in sender._items.values())


def test_unknown_hash_without_data_is_an_error() -> None:
    receiver = ProcessorCache(1000)
    lost = MultiModalFeatureSpec("image", "h1", PlaceholderRange(0, 4))
    with pytest.raises(ValueError, match="out of sync"):
        receiver.receive([lost])
    with pytest.raises(ValueError, match=">= 0"):
        ProcessorCache(-1)
