"""EncoderCacheManager: outputs shared by content hash across requests, kept after their
last user as freeable, evicted oldest first and only when space is needed, bounded by
the compute budget per step and by the cache size; integrity after every operation."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kvserve.core.encoder_cache_manager import EncoderCacheManager
from kvserve.multimodal import MultiModalFeatureSpec, PlaceholderRange


@dataclass
class _Request:
    request_id: str
    mm_features: list[MultiModalFeatureSpec] = field(default_factory=list)


def _request(request_id: str, *items: tuple[str, int]) -> _Request:
    features, offset = [], 0
    for mm_hash, size in items:
        features.append(
            MultiModalFeatureSpec("image", mm_hash, PlaceholderRange(offset=offset, length=size))
        )
        offset += size + 3
    return _Request(request_id, features)


def test_shared_by_hash_and_reused_after_the_last_user_left() -> None:
    cache = EncoderCacheManager(cache_size=100)
    a = _request("a", ("img1", 40))
    b = _request("b", ("img1", 40))
    assert not cache.check_and_update_cache(a, 0)
    assert cache.can_allocate(a, 0, encoder_compute_budget=64, num_embeds_to_schedule=0)
    cache.allocate(a, 0)
    cache.check_integrity()
    assert cache.check_and_update_cache(b, 0)  # b reuses a's output: no encoder run
    assert cache.get_cached_input_ids(b) == {0}
    cache.free(a)
    cache.free(b)
    cache.check_integrity()
    assert cache.num_free_slots == 60 and cache.num_freeable_slots == 100
    c = _request("c", ("img1", 40))
    assert cache.check_and_update_cache(c, 0)  # freeable, not gone
    assert cache.num_freeable_slots == 60
    cache.check_integrity()
    assert cache.get_freed_mm_hashes() == []


def test_eviction_is_lazy_and_oldest_first() -> None:
    cache = EncoderCacheManager(cache_size=100)
    reqs = [_request(f"r{i}", (f"img{i}", 30)) for i in range(3)]
    for r in reqs:
        assert cache.can_allocate(r, 0, 100, 0)
        cache.allocate(r, 0)
    for r in reqs[::-1]:  # img2 becomes freeable first, img0 last
        cache.free(r)
    cache.check_integrity()
    big = _request("big", ("img9", 50))
    # 10 free: img2 then img1 go (FIFO of becoming freeable), img0 stays.
    assert cache.can_allocate(big, 0, 100, 0)
    assert cache.get_freed_mm_hashes() == ["img2", "img1"]
    assert cache.get_freed_mm_hashes() == []
    cache.allocate(big, 0)
    cache.check_integrity()
    assert cache.check_and_update_cache(_request("again", ("img0", 30)), 0)
    assert not cache.check_and_update_cache(_request("gone", ("img1", 30)), 0)


def test_budgets_refuse_what_does_not_fit() -> None:
    cache = EncoderCacheManager(cache_size=100)
    a = _request("a", ("img1", 60), ("img2", 30))
    assert not cache.can_allocate(a, 0, encoder_compute_budget=50, num_embeds_to_schedule=0)
    assert cache.can_allocate(a, 0, 100, 0)
    cache.allocate(a, 0)
    # 40 free; with 20 tokens already scheduled this step, 30 more do not fit.
    assert not cache.can_allocate(a, 1, 100, num_embeds_to_schedule=20)
    assert cache.can_allocate(a, 1, 100, num_embeds_to_schedule=10)
    held = _request("b", ("img3", 70))
    assert not cache.can_allocate(held, 0, 100, 0)  # the referenced 60 cannot be evicted
    assert cache.get_freed_mm_hashes() == []
    with pytest.raises(ValueError, match="cached already"):
        cache.allocate(_request("c", ("img1", 60)), 0)
    cache.check_integrity()


def test_freeing_twice_or_unknown_inputs_is_harmless() -> None:
    cache = EncoderCacheManager(cache_size=10)
    a = _request("a", ("img1", 5))
    cache.allocate(a, 0)
    cache.free_encoder_input(a, 0)
    cache.free_encoder_input(a, 0)
    cache.free(_request("other", ("img1", 5)))
    cache.check_integrity()
    assert cache.num_freeable_slots == 10
    with pytest.raises(ValueError, match="positive"):
        EncoderCacheManager(0)
