"""The scheduler tests' Driver factory: a real Scheduler over a small pool of tiny blocks."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvserve.config import SchedulerConfig, SpeculativeConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import RequestStatus
from kvserve.core.sched.scheduler import Scheduler
from kvserve.protocol.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from tests.core.sched.driver import BS, Driver


def build_scheduler(
    num_blocks: int = 100,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int = 256,
    enable_prefix_caching: bool = True,
    speculative_config: SpeculativeConfig | None = None,
    max_concurrent_batches: int = 1,
    num_mamba_groups: int = 0,
    **scheduler_kwargs: Any,
) -> Scheduler:
    """A real Scheduler over a pool of tiny blocks, built from its config sections: no
    model is resolved or loaded. ``num_mamba_groups``: Mamba groups beside the attention
    group (a hybrid model's layout; each request holds one state block in each)."""
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8)
    groups = [KVCacheGroupSpec(["layers.0.attn"], spec)]
    mamba = MambaSpec(
        block_size=BS, conv_state_shape=(3, 8), ssm_state_shape=(2, 4, 4),
        mamba_cache_mode="align" if enable_prefix_caching else "none",
    )  # fmt: skip
    groups += [KVCacheGroupSpec([f"layers.{i + 1}.mamba"], mamba) for i in range(num_mamba_groups)]
    kv_config = KVCacheConfig(num_blocks, groups)
    manager = KVCacheManager(
        kv_config,
        max_model_len,
        enable_caching=enable_prefix_caching,
        log_stats=True,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            **scheduler_kwargs,
        ),
        manager,
        speculative_config=speculative_config,
        max_concurrent_batches=max_concurrent_batches,
    )


@pytest.fixture
def make_driver() -> Iterator[Callable[..., Driver]]:
    drivers: list[Driver] = []

    def make(**kwargs: Any) -> Driver:
        drivers.append(Driver(build_scheduler(**kwargs)))
        return drivers[-1]

    yield make
    for driver in drivers:  # whatever a test left behind must free every block
        sched = driver.scheduler
        sched.finish_requests(list(sched.requests), RequestStatus.FINISHED_ABORTED)
        sched.check_integrity()
        pool = sched.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_blocks - 1
        assert not sched.requests and not sched.running and not sched.waiting
