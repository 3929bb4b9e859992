"""CUDA graph capture sizes: vLLM's names and defaults, resolved against the scheduler."""

from __future__ import annotations

import pytest

from kvserve.args.engine_args import EngineArgs
from kvserve.config.compilation import CompilationConfig, default_capture_sizes


def resolved(max_num_seqs: int = 1024, max_tokens: int = 8192, **kw: object) -> CompilationConfig:
    config = CompilationConfig(**kw)  # type: ignore[arg-type]
    config.resolve(max_num_seqs, max_tokens)
    return config


def test_default_sizes_are_vllms() -> None:
    sizes = default_capture_sizes(512)
    assert sizes[:5] == [1, 2, 4, 8, 16]
    assert sizes[sizes.index(248) + 1 : sizes.index(248) + 3] == [256, 272]
    assert sizes[-1] == 512 and sizes == sorted(set(sizes))
    assert default_capture_sizes(3) == [1, 2]


def test_default_max_is_512_capped_by_max_num_seqs_and_tokens() -> None:
    assert resolved().max_cudagraph_capture_size == 512
    assert resolved(max_num_seqs=128).cudagraph_capture_sizes == default_capture_sizes(128)
    assert resolved(max_num_seqs=256, max_tokens=20).max_cudagraph_capture_size == 16


def test_given_sizes_are_sorted_and_cut_to_what_a_decode_step_holds() -> None:
    config = resolved(max_num_seqs=64, cudagraph_capture_sizes=[32, 1, 128, 4, 4])
    assert config.cudagraph_capture_sizes == [1, 4, 32]
    assert config.max_cudagraph_capture_size == 32
    assert resolved(max_cudagraph_capture_size=24).cudagraph_capture_sizes == [1, 2, 4, 8, 16, 24]


def test_enforce_eager_captures_nothing() -> None:
    config = resolved(enforce_eager=True)
    assert (config.cudagraph_capture_sizes, config.max_cudagraph_capture_size) == ([], 0)


def test_bad_values_name_the_field() -> None:
    with pytest.raises(ValueError, match="cudagraph_capture_sizes"):
        resolved(cudagraph_capture_sizes=[0, 8])
    with pytest.raises(ValueError, match="max_cudagraph_capture_size=16 must equal"):
        resolved(cudagraph_capture_sizes=[1, 8], max_cudagraph_capture_size=16)
    with pytest.raises(ValueError, match="max_cudagraph_capture_size"):
        resolved(max_cudagraph_capture_size=-1)


def test_engine_args_reach_the_config() -> None:
    config = EngineArgs(
        max_num_seqs=64, compilation_config={"cudagraph_capture_sizes": [1, 2, 8]}
    ).create_engine_config()
    assert config.compilation_config.cudagraph_capture_sizes == [1, 2, 8]
    config = EngineArgs(max_num_seqs=64, cuda_graph_sizes=[4, 16]).create_engine_config()
    assert config.compilation_config.cudagraph_capture_sizes == [4, 16]
    config = EngineArgs(max_num_seqs=64, enforce_eager=True).create_engine_config()
    assert config.compilation_config.cudagraph_capture_sizes == []
    assert (
        EngineArgs(max_num_seqs=64)
        .create_engine_config()
        .compilation_config.max_cudagraph_capture_size
        == 64
    )
