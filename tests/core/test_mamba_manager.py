"""MambaManager through the real KVCacheManager: one state block per request and group
(without prefix caching), block-end states as cache entries (with it), no leak after
frees; and the memory a hybrid saves against full attention, counted by the managers."""

from __future__ import annotations

from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.protocol.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    build_kv_cache_config,
    group_capacity_per_gib,
)
from tests.core.conftest import BLOCK_SIZE, MakeRequest

MAMBA = MambaSpec(block_size=BLOCK_SIZE, conv_state_shape=(3, 8), ssm_state_shape=(2, 4, 4))
ALIGNED = MambaSpec(
    block_size=BLOCK_SIZE, conv_state_shape=(3, 8), ssm_state_shape=(2, 4, 4),
    mamba_cache_mode="align",
)  # fmt: skip
ATTENTION = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8)


def _hybrid(num_blocks: int, mamba: MambaSpec = MAMBA) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks,
        [KVCacheGroupSpec(["l0.attn"], ATTENTION), KVCacheGroupSpec(["l1.mamba"], mamba)],
    )


def test_one_state_block_per_request_without_caching(make_request: MakeRequest) -> None:
    manager = KVCacheManager(_hybrid(20), max_model_len=64, enable_caching=False)
    request = make_request(list(range(10, 23)))  # 13 tokens
    assert manager.allocate_slots(request, 13) is not None
    attention, state = manager.get_block_ids(request.request_id)
    assert len(attention) == 4 and len(state) == 1
    request.num_computed_tokens = 13
    for _ in range(6):  # decode: attention grows, the state block stays
        request.append_output_token_ids(7)
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
        manager.check_integrity()
    attention, again = manager.get_block_ids(request.request_id)
    assert len(attention) == 5 and again == state
    manager.free(request)
    manager.check_integrity()
    assert manager.block_pool.get_num_free_blocks() == 19


def test_block_end_states_are_hits_with_caching(make_request: MakeRequest) -> None:
    manager = KVCacheManager(_hybrid(40, ALIGNED), max_model_len=64, enable_caching=True)
    prompt = list(range(100, 118))  # 18 tokens: block ends at 4, 8, 12, 16
    first = make_request(prompt)
    assert manager.allocate_slots(first, 18) is not None
    # Blocks for the state at the last block end (16) and the live state; the block
    # ends the prefill skips over are not kept.
    assert [b.is_null for b in manager.get_blocks(first.request_id).blocks[1]] == [
        True, True, True, False, False,
    ]  # fmt: skip
    manager.free(first)
    first = make_request(prompt)
    assert manager.allocate_slots(first, 18) is not None
    first.num_computed_tokens = 18
    first.append_output_token_ids(7)
    # The next step hashes the block-end states the prefill wrote (they are written
    # once the prefill ran); the step after frees all but the live state (the block of
    # token 19), the freed ones staying cache entries.
    for _ in range(2):
        assert manager.allocate_slots(first, 1) is not None
        first.num_computed_tokens += 1
        first.append_output_token_ids(7)
        manager.check_integrity()
    state_blocks = manager.get_blocks(first.request_id).blocks[1]
    assert [b.is_null for b in state_blocks] == [True, True, True, True, False]
    second = make_request(prompt)
    hits, num_hit = manager.get_computed_blocks(second)
    assert num_hit == 16  # resumes from the state after block 3, computes 2 tokens
    assert [b.is_null for b in hits.blocks[1]] == [True, True, True, False]
    assert manager.allocate_slots(second, 2, num_hit, hits) is not None
    manager.check_integrity()
    manager.free(first)
    manager.free(second)
    manager.check_integrity()
    assert manager.block_pool.get_num_free_blocks() == 39


def test_hybrid_holds_more_long_requests_than_full_attention(make_request: MakeRequest) -> None:
    """Granite-4.0-H-Tiny-like shapes (40 layers, 4 of them attention; Mamba-2 with
    128 heads x 64, state 128, 1 group, conv 4; attention 8 KV heads x 128) against the
    same 40 layers all full attention, in 8 GiB of float32 cache, with 8,192-token
    requests allocated through KVCacheManager until the pool runs out."""
    memory, num_tokens = 8 << 30, 8192
    mamba = MambaSpec(
        block_size=16, conv_state_shape=(3, 128 * 64 + 2 * 128), ssm_state_shape=(128, 64, 128)
    )
    block_size = 16
    while 2 * 8 * 128 * 4 * block_size < mamba.state_bytes:  # the engine's block size rule
        block_size *= 2
    attention = FullAttentionSpec(block_size=block_size, num_kv_heads=8, head_size=128)
    mamba = MambaSpec(
        block_size=block_size,
        conv_state_shape=mamba.conv_state_shape,
        ssm_state_shape=mamba.ssm_state_shape,
        page_size_padded=attention.page_size_bytes,
    )
    layouts = {
        "hybrid": {f"l{i}": attention if i % 10 == 9 else mamba for i in range(40)},
        "full attention": dict.fromkeys((f"l{i}" for i in range(40)), attention),
    }
    fitted = {}
    for name, layers in layouts.items():
        config = build_kv_cache_config(layers, memory)
        manager = KVCacheManager(config, max_model_len=num_tokens, enable_caching=False)
        count = 0
        while True:
            request = make_request(list(range(num_tokens)), block_size=block_size)
            if manager.allocate_slots(request, num_tokens) is None:
                break
            count += 1
        manager.check_integrity()
        fitted[name] = count
        per_gib = group_capacity_per_gib(config)
        print(
            f"{name}: {config.num_blocks} blocks of {config.bytes_per_block} bytes in 8 GiB, "
            f"{count} concurrent {num_tokens}-token requests; per GiB {per_gib}"
        )
    assert fitted["hybrid"] > 2 * fitted["full attention"] > 0
