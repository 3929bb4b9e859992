"""DeviceConfig: the device and the forced attention backend, checked when built."""

from __future__ import annotations

import pytest

from kvserve.args.engine_args import EngineArgs
from kvserve.config.runtime import DeviceConfig


def test_attention_backend_is_checked_naming_the_field() -> None:
    assert DeviceConfig("cpu", "FLASH_ATTN").attention_backend == "FLASH_ATTN"
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        DeviceConfig("cpu", "flash")
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineArgs(attention_backend="XFORMERS").create_engine_config()
