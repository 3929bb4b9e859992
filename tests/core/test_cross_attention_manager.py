"""CrossAttentionManager: a request's encoder K/V blocks are allocated whole at its first
allocation, whatever its decoder length, held unchanged as it decodes, shared with a
request whose encoder input has the same hash (a reference, no new blocks), never
prefix-cache entries, and freed with the last request that holds them."""

from __future__ import annotations

from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request
from kvserve.core.single_type_kv_cache_manager import CrossAttentionManager
from kvserve.multimodal import MultiModalFeatureSpec, PlaceholderRange
from kvserve.protocol.kv_cache_interface import (
    CrossAttentionSpec,
    FullAttentionSpec,
    build_kv_cache_config,
)
from kvserve.sampling_params import SamplingParams

BLOCK = 4
ENCODER_LEN = 10  # 3 blocks
SELF = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8)
CROSS = CrossAttentionSpec(
    block_size=BLOCK, num_kv_heads=2, head_size=8, max_encoder_len=ENCODER_LEN
)


def _manager(num_blocks: int = 16) -> KVCacheManager:
    specs = {"dec.0.self": SELF, "dec.1.self": SELF, "dec.0.cross": CROSS, "dec.1.cross": CROSS}
    config = build_kv_cache_config(specs, 0, num_blocks_override=num_blocks)
    assert [type(g.kv_cache_spec) for g in config.kv_cache_groups] == [
        FullAttentionSpec,
        CrossAttentionSpec,
    ]
    # Equal page sizes: layer i of both groups shares one tensor.
    assert [t.shared_by for t in config.kv_cache_tensors] == [
        ["dec.0.self", "dec.0.cross"],
        ["dec.1.self", "dec.1.cross"],
    ]
    # Encoder-decoder models run with prefix caching off (EngineConfig).
    return KVCacheManager(config, max_model_len=64, enable_caching=False)


def _request(request_id: str, audio_hash: str, num_prompt: int = 3) -> Request:
    feature = MultiModalFeatureSpec("audio", audio_hash, PlaceholderRange(0, ENCODER_LEN))
    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(1, 1 + num_prompt)),
        sampling_params=SamplingParams(max_tokens=8),
        eos_token_id=0,
        mm_features=[feature],
    )


def _cross(manager: KVCacheManager) -> CrossAttentionManager:
    cross = manager.coordinator.single_type_managers[1]
    assert isinstance(cross, CrossAttentionManager)
    return cross


def test_encoder_blocks_whole_at_first_allocation_then_constant() -> None:
    manager = _manager()
    request = _request("a", "audio-1")
    new = manager.allocate_slots(request, 3)
    assert new is not None
    self_ids, cross_ids = new.get_block_ids()
    assert len(self_ids) == 1 and len(cross_ids) == 3  # 3 decoder tokens, 10 encoder ones
    request.num_computed_tokens = 3
    for _ in range(6):  # decoding grows the self-attention table only
        more = manager.allocate_slots(request, 1)
        assert more is not None and more.get_block_ids()[1] == []
        request.num_computed_tokens += 1
    assert manager.get_block_ids("a")[1] == cross_ids
    assert len(manager.get_block_ids("a")[0]) == 3
    manager.check_integrity()
    manager.free(request)
    manager.check_integrity()
    assert manager.block_pool.get_num_free_blocks() == 15
    assert all(v == 0 for v in manager.request_census().values())


def test_same_audio_shares_blocks_and_the_last_holder_frees_them() -> None:
    manager = _manager()
    a, b, c = _request("a", "audio-1"), _request("b", "audio-1"), _request("c", "audio-2")
    free_before = manager.block_pool.get_num_free_blocks()
    for request in (a, b, c):
        assert manager.allocate_slots(request, 3) is not None
    cross_a, cross_b, cross_c = (manager.get_block_ids(r)[1] for r in "abc")
    assert cross_a == cross_b and not set(cross_a) & set(cross_c)
    # a and b took 3 + 1 + 1 blocks, c 3 + 1: the shared encoder K/V count once.
    assert free_before - manager.block_pool.get_num_free_blocks() == 9
    assert {manager.block_pool.blocks[i].ref_cnt for i in cross_a} == {2}
    manager.check_integrity()
    manager.free(a)  # b still reads them
    assert {manager.block_pool.blocks[i].ref_cnt for i in cross_a} == {1}
    d = _request("d", "audio-1")
    assert manager.allocate_slots(d, 3) is not None
    assert manager.get_block_ids("d")[1] == cross_a
    for request in (b, d, c):
        manager.free(request)
    manager.check_integrity()
    assert manager.block_pool.get_num_free_blocks() == free_before
    assert all(v == 0 for v in manager.request_census().values())
    # A new request with the old audio gets fresh blocks: nothing is cached by hash.
    assert manager.allocate_slots(_request("e", "audio-1"), 3) is not None
    assert {manager.block_pool.blocks[i].ref_cnt for i in manager.get_block_ids("e")[1]} == {1}


def test_no_room_changes_nothing_and_the_pool_bounds_one_request() -> None:
    manager = _manager(num_blocks=5)  # 4 usable: 1 self block + 3 encoder blocks
    a = _request("a", "audio-1")
    assert manager.fits_in_pool(3)
    assert not manager.fits_in_pool(5)  # 2 self blocks + 3 encoder blocks
    assert manager.allocate_slots(a, 3) is not None
    b = _request("b", "audio-2")
    assert manager.allocate_slots(b, 3) is None
    manager.check_integrity()
    assert manager.get_block_ids("b") == ([], [])
    # The same audio needs only its self-attention block, which is not there either.
    c = _request("c", "audio-1")
    assert manager.allocate_slots(c, 3) is None
    for request in (a, b, c):  # the scheduler frees every request that ends
        manager.free(request)
    assert all(v == 0 for v in manager.request_census().values())
    manager.check_integrity()
