"""Factories shared by the core tests: requests with block hashes, KV cache configs."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest

from kvserve.core.kv_cache_utils import get_request_block_hasher
from kvserve.core.request import Request
from kvserve.protocol.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from kvserve.sampling_params import SamplingParams

BLOCK_SIZE = 4
EOS = 2

MakeRequest = Callable[..., Request]


def kv_cache_config(num_blocks: int, block_size: int = BLOCK_SIZE) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8)
    return KVCacheConfig(num_blocks, [KVCacheGroupSpec(["layers.0.attn"], spec)])


@pytest.fixture
def make_request() -> MakeRequest:
    """Builds Requests with hashed blocks; arrival times increase with each call."""
    counter = itertools.count()

    def make(
        prompt: list[int] | int,
        request_id: str | None = None,
        block_size: int = BLOCK_SIZE,
        seed: int = 0,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        eos_token_id: int | None = EOS,
        **sampling: Any,
    ) -> Request:
        n = next(counter)
        prompt_ids = list(range(100, 100 + prompt)) if isinstance(prompt, int) else prompt
        sampling.setdefault("max_tokens", 16)
        return Request(
            request_id=request_id or f"req-{n}",
            prompt_token_ids=prompt_ids,
            sampling_params=SamplingParams(**sampling),
            eos_token_id=eos_token_id,
            arrival_time=float(n) if arrival_time is None else arrival_time,
            priority=priority,
            cache_salt=cache_salt,
            block_hasher=get_request_block_hasher(block_size, seed),
        )

    return make
