"""PrefixIndex: hashes a request's blocks exactly as the engine does (its Request and block
hasher; tests/distributed/test_kv_events_engine.py shows the engine publishes those same
hashes), follows stored / removed / cleared events per instance, and routes to the
longest cached prefix, then the least loaded."""

from __future__ import annotations

import pytest

from kvserve.core.kv_cache_utils import get_request_block_hasher
from kvserve.core.prefix_index import PrefixIndex
from kvserve.core.request import Request
from kvserve.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvserve.sampling_params import SamplingParams

BLOCK = 16
CONVERSATION = list(range(500, 600))  # 6 full blocks + 4 tokens
OTHER = list(range(9000, 9040))


def _engine_hashes(tokens: list[int], salt: str | None = None, seed: int = 0) -> list[bytes]:
    hasher = get_request_block_hasher(BLOCK, seed=seed)
    request = Request("r", tokens, SamplingParams(), None, cache_salt=salt, block_hasher=hasher)
    return list(request.block_hashes)


def _stored(hashes: list[bytes], tokens: list[int], group_id: int | None = 0) -> BlockStored:
    return BlockStored(
        block_hashes=hashes, parent_block_hash=None, token_ids=tokens[: len(hashes) * BLOCK],
        block_size=BLOCK, medium="GPU", group_id=group_id,
    )  # fmt: skip


@pytest.mark.parametrize(("salt", "seed"), [(None, 0), ("tenant-a", 0), (None, 7)])
def test_hashes_equal_the_engines(salt: str | None, seed: int) -> None:
    index = PrefixIndex(BLOCK, hash_seed=seed)
    assert index.block_hashes(CONVERSATION, salt) == _engine_hashes(CONVERSATION, salt, seed)


def test_follows_events_and_matches_the_longest_prefix() -> None:
    index = PrefixIndex(BLOCK)
    turn1 = CONVERSATION[:50]  # 3 full blocks
    index.apply("a", [_stored(_engine_hashes(turn1), turn1)])
    index.apply("b", [_stored(_engine_hashes(OTHER), OTHER)])
    # The next turn extends the first: "a" holds its first 3 blocks, "b" nothing of it.
    assert index.match(CONVERSATION) == {"a": 48, "b": 0}
    assert index.choose(CONVERSATION, {"a": (5,), "b": (0,)}) == "a"  # the prefix beats load
    assert index.match(CONVERSATION, cache_salt="other tenant") == {"a": 0, "b": 0}
    # Evicting block 1 cuts "a"'s prefix at block 1 even though block 2 is still held.
    index.apply("a", [BlockRemoved(block_hashes=[_engine_hashes(turn1)[1]], medium="GPU")])
    assert index.match(CONVERSATION)["a"] == 16
    index.apply("a", [AllBlocksCleared()])
    assert index.match(CONVERSATION)["a"] == 0 and index.num_blocks("a") == 0


def test_ties_go_to_the_least_loaded_then_by_name() -> None:
    index = PrefixIndex(BLOCK)
    assert index.choose(CONVERSATION, {"b": (1, 3), "a": (2, 0), "c": (1, 3)}) == "b"
    assert index.choose(CONVERSATION, {"b": (1, 3), "a": (1, 2)}) == "a"
    with pytest.raises(ValueError, match="no instance"):
        index.choose(CONVERSATION, {})


def test_only_the_full_attention_group_counts() -> None:
    index = PrefixIndex(BLOCK)
    hashes = _engine_hashes(CONVERSATION)
    index.apply("a", [_stored(hashes, CONVERSATION, group_id=1)])  # a sliding-window group
    assert index.match(CONVERSATION)["a"] == 0
    index.apply("a", [_stored(hashes, CONVERSATION, group_id=None)])
    assert index.match(CONVERSATION)["a"] == 6 * BLOCK
    index.apply("a", [BlockRemoved(block_hashes=hashes, group_id=1)])
    assert index.match(CONVERSATION)["a"] == 6 * BLOCK


def test_forget_and_block_size_mismatch() -> None:
    index = PrefixIndex(BLOCK)
    index.apply("a", [_stored(_engine_hashes(CONVERSATION), CONVERSATION)])
    index.forget("a")
    assert index.instances == [] and index.match(CONVERSATION) == {}
    bad = BlockStored(
        block_hashes=[b"x" * 32], parent_block_hash=None, token_ids=[1] * 32, block_size=32
    )
    with pytest.raises(ValueError, match="blocks of 32 tokens"):
        index.apply("a", [bad])
    with pytest.raises(ValueError, match="positive"):
        PrefixIndex(0)


def test_a_tenants_requests_go_where_its_own_prefix_lives() -> None:
    """The router salts as the instances do (tenants.tenant_salt): a tenant's prefix on
    one instance draws that tenant's next turn, not another tenant's same prompt."""
    from kvserve.entrypoints.openai.tenants import tenant_salt

    index = PrefixIndex(BLOCK)
    alpha = tenant_salt("alpha", None)
    index.apply("a", [_stored(_engine_hashes(CONVERSATION, alpha), CONVERSATION)])
    loads = {"a": (1,), "b": (0,)}
    assert index.choose(CONVERSATION, loads, alpha) == "a"
    assert index.choose(CONVERSATION, loads, tenant_salt("beta", None)) == "b"  # nothing cached
    assert tenant_salt("alpha", "mine") != tenant_salt("beta", "mine") != "mine"
