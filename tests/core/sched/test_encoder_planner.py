"""The scheduler's encoder side on a real Scheduler (no model): encoder work within the
encoder budget beside the token budget, outputs shared by hash and freed lazily, chunks
that stop before a bidirectional image (or cut into one where the model allows it), a
prefix hit that ends inside an image, and image hashes in the block keys."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvserve.config import MultiModalConfig, SchedulerConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.kv_cache_utils import get_request_block_hasher
from kvserve.core.request import Request
from kvserve.core.sched.encoder_planner import EncoderPlanner
from kvserve.core.sched.scheduler import Scheduler
from kvserve.multimodal import MultiModalFeatureSpec, PlaceholderRange
from kvserve.protocol.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from kvserve.sampling_params import SamplingParams
from kvserve.transformers_utils.multimodal_arch import MultiModalArch
from tests.core.sched.driver import BS, Driver

MakeDriver = Callable[..., Driver]


@pytest.fixture
def make_driver() -> MakeDriver:
    def make(
        max_num_batched_tokens: int = 32, bidirectional: bool = True, encoder_cache_size: int = 0
    ) -> Driver:
        arch = MultiModalArch(
            vision_config={}, mm_tokens_per_image=8, image_token_id=5, boi_token_id=3,
            eoi_token_id=4, bidirectional_items=bidirectional, max_tokens_per_item=8,
        )  # fmt: skip
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8)
        kv = KVCacheConfig(100, [KVCacheGroupSpec(["layers.0.attn"], spec)])
        manager = KVCacheManager(
            kv, 256, log_stats=True, max_num_batched_tokens=max_num_batched_tokens
        )
        encoder = EncoderPlanner(
            MultiModalConfig(encoder_cache_size=encoder_cache_size), arch, max_num_batched_tokens
        )
        return Driver(
            Scheduler(
                SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_model_len=256),
                manager,
                encoder=encoder,
            )
        )

    return make


def _request(
    rid: str, images: list[tuple[str, int, int]], length: int = 24, first: int = 100
) -> Request:
    """``images``: (hash, offset, length) each; the tokens are equal across requests
    (but for the ``first`` one, which keeps a request out of the others' prefix)."""
    features = [
        MultiModalFeatureSpec("image", h, PlaceholderRange(offset, n)) for h, offset, n in images
    ]
    prompt = [100 + (i % 50) for i in range(length)]
    prompt[0] = first
    for _, offset, n in images:
        prompt[offset : offset + n] = [5] * n
    return Request(
        rid,
        prompt,
        SamplingParams(max_tokens=2, ignore_eos=True),
        eos_token_id=2,
        block_hasher=get_request_block_hasher(BS, 0),
        mm_features=features,
    )


def test_chunk_stops_before_a_bidirectional_image_and_runs_it_whole(
    make_driver: MakeDriver,
) -> None:
    d = make_driver(max_num_batched_tokens=12)
    d.add(_request("a", [("img", 8, 8)]))
    out, _ = d.step()
    # 12 tokens would end inside the image [8, 16): the chunk stops at its start.
    assert out.num_scheduled_tokens == {"a": 8} and not out.scheduled_encoder_inputs
    out, _ = d.step()
    assert out.num_scheduled_tokens == {"a": 12}
    assert out.scheduled_encoder_inputs == {"a": [0]}
    d.run()
    manager = d.scheduler.encoder.cache
    assert manager is not None and "img" in manager.freeable  # kept, lazily freeable


def test_chunk_may_cut_an_image_where_the_model_allows(make_driver: MakeDriver) -> None:
    d = make_driver(max_num_batched_tokens=12, bidirectional=False)
    a = _request("a", [("img", 8, 8)])
    d.add(a)
    out, _ = d.step()
    assert out.num_scheduled_tokens == {"a": 12} and out.scheduled_encoder_inputs == {"a": [0]}
    manager = d.scheduler.encoder.cache
    assert manager is not None and manager.get_cached_input_ids(a) == {0}  # still needed
    out, _ = d.step()
    assert not out.scheduled_encoder_inputs  # the rest of the image reads the cached output
    assert manager.get_cached_input_ids(a) == set()  # in the KV now: reference dropped
    d.run()


def test_outputs_shared_by_hash_within_the_encoder_budget(make_driver: MakeDriver) -> None:
    d = make_driver(max_num_batched_tokens=64, encoder_cache_size=8)
    d.add(_request("a", [("x", 4, 8)]), _request("c", [("x", 4, 8)], length=20, first=99))
    out, _ = d.step()
    # One image's worth of encoder budget: a's image runs and c shares its output.
    assert out.scheduled_encoder_inputs == {"a": [0]}
    assert out.num_scheduled_tokens == {"a": 24, "c": 20}
    stats = d.scheduler.make_stats()
    assert stats is not None and stats.mm_stats is not None
    assert (stats.mm_stats.encoder_cache_queries, stats.mm_stats.encoder_cache_hits) == (2, 1)
    d.run()


def test_encoder_budget_and_lazy_fifo_eviction(make_driver: MakeDriver) -> None:
    d = make_driver(max_num_batched_tokens=64, encoder_cache_size=8)
    d.add(_request("a", [("x", 4, 8)]), _request("b", [("y", 4, 8)]))
    d.add(_request("c", [("x", 4, 8)], length=20, first=99))
    out, _ = d.step()
    # The budget holds one image: a's runs; b waits at its image (its text block came
    # from a's prefix), and c, behind it, waits too (first come, first served).
    assert out.num_scheduled_tokens == {"a": 24} and out.scheduled_encoder_inputs == {"a": [0]}
    manager = d.scheduler.encoder.cache
    assert manager is not None and list(manager.freeable) == ["x"]  # in a's KV: freeable
    out, _ = d.step()
    # y needs the space: x, the oldest freeable output, is evicted and the workers told.
    assert out.scheduled_encoder_inputs == {"b": [0]}
    assert out.free_encoder_mm_hashes == ["x"]
    # x must be encoded again and no budget is left: c stops before its image.
    assert out.num_scheduled_tokens["c"] == 4
    out, _ = d.step()
    assert out.scheduled_encoder_inputs == {"c": [0]}
    assert out.free_encoder_mm_hashes == ["y"]
    d.run()


def test_prefix_hit_inside_an_image_computes_the_rest_whole(make_driver: MakeDriver) -> None:
    d = make_driver(max_num_batched_tokens=32)
    d.add(_request("a", [("img", 6, 8)]))
    d.run()
    b = _request("b", [("img", 6, 8)])
    d.add(b)
    out, _ = d.step()
    # Blocks of 4: the hit covers 20 of 24 tokens (a's output is freeable but cached).
    assert b.num_cached_tokens == 20 and out.num_scheduled_tokens == {"b": 4}
    d.run()


def test_image_hashes_key_the_blocks() -> None:
    hasher = get_request_block_hasher(BS, 0)
    a, b, a2 = (_request(r, [(h, 6, 8)]) for r, h in [("a", "h1"), ("b", "h2"), ("c", "h1")])
    assert a.prompt_token_ids == b.prompt_token_ids
    # Block 0 (tokens 0-3) holds no image: shared; from block 1 on the hashes differ.
    assert a.block_hashes[0] == b.block_hashes[0]
    assert all(x != y for x, y in zip(a.block_hashes[1:], b.block_hashes[1:], strict=True))
    assert a.block_hashes == a2.block_hashes  # same image, same place: same keys
    moved = _request("d", [("h1", 7, 8)])
    assert moved.block_hashes[1] != a.block_hashes[1]  # same image elsewhere: other keys
    assert hasher(a) == []  # all full blocks hashed already


def test_items_that_can_never_fit_are_refused(make_driver: MakeDriver) -> None:
    d = make_driver(max_num_batched_tokens=6)
    with pytest.raises(ValueError, match="more than max_num_batched_tokens"):
        d.add(_request("a", [("img", 4, 8)]))
    assert not d.scheduler.requests
