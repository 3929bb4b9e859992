"""--kv-cache-dtype int8 and vLLM's fp8 names: one int8 cache, and the features that
cannot read it declining at config time with kv_cache_dtype in the message."""

from __future__ import annotations

import pytest

from kvserve.args.engine_args import EngineArgs
from kvserve.config import KVTransferConfig


@pytest.mark.parametrize("name", ["int8", "fp8", "fp8_e4m3", "fp8_e5m2"])
def test_quantized_names_share_the_int8_cache_and_turn_cascade_off(name: str) -> None:
    config = EngineArgs(kv_cache_dtype=name).create_engine_config()
    assert config.cache_config.kv_dtype(config.model_config.dtype) == "int8"
    # Cascade's shared-prefix pass reads float pages: off, not an error (it is on by default).
    assert config.model_config.disable_cascade_attn


def test_unknown_kv_cache_dtype_names_the_field() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineArgs(kv_cache_dtype="fp4").create_engine_config()


def test_kv_connectors_refuse_an_int8_cache() -> None:
    transfer = KVTransferConfig(kv_connector="SharedStorageConnector")
    with pytest.raises(ValueError, match=r"kv_cache_dtype='int8'.*KV connector"):
        EngineArgs(kv_cache_dtype="int8", kv_transfer_config=transfer).create_engine_config()


def test_gpu_backends_refuse_an_int8_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8'.*CPU attention backend"):
        EngineArgs(kv_cache_dtype="fp8", device="cuda").create_engine_config()
    monkeypatch.setenv("KVSERVE_ATTENTION_BACKEND", "TRITON")
    with pytest.raises(ValueError, match=r"kv_cache_dtype='int8'.*Triton"):
        EngineArgs(kv_cache_dtype="int8").create_engine_config()
