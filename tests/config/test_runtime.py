"""DeviceConfig (the device and the forced attention backend) and CacheConfig's share,
checked when built."""

from __future__ import annotations

import pytest

from kvserve.args.engine_args import EngineArgs
from kvserve.config.runtime import CacheConfig, DeviceConfig


def test_attention_backend_is_checked_naming_the_field() -> None:
    assert DeviceConfig("cpu", "FLASH_ATTN").attention_backend == "FLASH_ATTN"
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        DeviceConfig("cpu", "flash")
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineArgs(attention_backend="XFORMERS").create_engine_config()


def test_gpu_memory_utilization_is_a_share() -> None:
    assert CacheConfig(gpu_memory_utilization=1.0).gpu_memory_utilization == 1.0
    for bad in (0.0, 1.01, True):
        with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
            CacheConfig(gpu_memory_utilization=bad)
