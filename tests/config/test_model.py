"""ModelConfig's dtype: checked at once, resolved for the device by EngineConfig."""

from __future__ import annotations

import pytest

from kvserve.args.engine_args import EngineArgs
from kvserve.config import ModelConfig, resolve_dtype


@pytest.mark.parametrize(
    ("dtype", "device", "expected"),
    [
        ("auto", "cpu", "float32"),
        ("auto", "cuda", "bfloat16"),
        ("float32", "cuda", "float32"),
        ("float", "cpu", "float32"),
        ("float16", "cuda", "float16"),
        ("half", "cuda", "float16"),
        ("bfloat16", "cuda", "bfloat16"),
    ],
)
def test_resolve_dtype(dtype: str, device: str, expected: str) -> None:
    assert resolve_dtype(dtype, device) == expected


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "half"])
def test_cpu_refuses_narrow_dtypes_naming_the_field(dtype: str) -> None:
    with pytest.raises(ValueError, match=f"dtype={dtype!r} needs a CUDA device"):
        resolve_dtype(dtype, "cpu")


def test_unknown_dtype_is_a_value_error_naming_the_field() -> None:
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("float64", "cuda")
    with pytest.raises(ValueError, match="dtype must be one of"):
        ModelConfig(dtype="int8")


def test_engine_config_resolves_auto_for_its_device() -> None:
    assert ModelConfig(dtype="auto", max_model_len=256).dtype == "auto"  # no device yet
    config = EngineArgs(device="cpu", max_model_len=256).create_engine_config()
    assert config.model_config.dtype == "float32"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        EngineArgs(device="cpu", dtype="bfloat16", max_model_len=256).create_engine_config()
