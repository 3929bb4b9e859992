"""EngineArgs: CLI flags and keyword arguments become one validated EngineConfig."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvserve.args.engine_args import EngineArgs, parse_bytes
from kvserve.config import KVTransferConfig


def parse(argv: list[str]) -> EngineArgs:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    return EngineArgs.from_cli_args(parser.parse_args(argv))


def test_vllm_flag_names_reach_the_config() -> None:
    config = parse(
        [
            "--max-model-len",
            "1024",
            "--max-num-seqs",
            "7",
            "--max-num-batched-tokens",
            "96",
            "--block-size",
            "32",
            "--kv-cache-memory",
            "64MiB",
            "--no-enable-prefix-caching",
            "--scheduling-policy",
            "priority",
            "--kv-cache-dtype",
            "bfloat16",
            "--async-scheduling",
        ]
    ).create_engine_config()
    assert config.model_config.max_model_len == 1024
    assert config.scheduler_config.max_num_seqs == 7
    assert config.scheduler_config.max_num_batched_tokens == 96
    assert config.scheduler_config.policy == "priority"
    assert config.cache_config.block_size == 32
    assert config.cache_config.kv_cache_memory == 64 << 20
    assert not config.cache_config.enable_prefix_caching
    assert config.cache_config.kv_dtype(config.model_config.dtype) == "bfloat16"
    assert config.scheduler_config.async_scheduling
    assert not parse([]).async_scheduling  # opt-in


@pytest.mark.parametrize(
    ("text", "value"), [("2G", 2 << 30), ("512MiB", 512 << 20), ("1e6", 10**6), ("4096", 4096)]
)
def test_parse_bytes(text: str, value: int) -> None:
    assert parse_bytes(text) == value


def test_async_scheduling_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineArgs(async_scheduling="yes").create_engine_config()  # type: ignore[arg-type]


def test_bad_size_names_the_field() -> None:
    with pytest.raises(ValueError, match="kv_cache_memory"):
        parse_bytes("lots")


def test_kv_cache_dtype_defaults_to_the_model_dtype_and_is_validated() -> None:
    config = EngineArgs().create_engine_config()
    assert config.cache_config.kv_dtype(config.model_config.dtype) == "float32"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineArgs(kv_cache_dtype="fp4").create_engine_config()


def test_kv_cache_config_turns_on_the_tiered_connector(tmp_path: Path) -> None:
    yaml_file = tmp_path / "tiers.yaml"
    yaml_file.write_text("chunk_size: 256\nlocal_cpu: true\n")
    config = parse(["--kv-cache-config", str(yaml_file)]).create_engine_config()
    transfer = config.kv_transfer_config
    assert isinstance(transfer, KVTransferConfig)
    assert transfer.kv_connector == "TieredCacheConnector"
    assert transfer.kv_connector_extra_config["kv_cache_config"] == str(yaml_file)

    # With a connector already named, the file is handed to it and the caller's object is kept.
    given = KVTransferConfig(
        kv_connector="MultiConnector", kv_connector_extra_config={"connectors": []}
    )
    merged = EngineArgs(kv_transfer_config=given, kv_cache_config=str(yaml_file))
    assert merged.create_engine_config().kv_transfer_config.kv_connector_extra_config == {
        "connectors": [],
        "kv_cache_config": str(yaml_file),
    }
    assert "kv_cache_config" not in given.kv_connector_extra_config


def test_unknown_keyword_is_rejected() -> None:
    with pytest.raises(ValueError, match="bogus"):
        EngineArgs.from_kwargs(bogus=1)


def test_logits_processors_load_by_name_and_bad_names_fail_naming_the_field() -> None:
    from tests.engine_core.faulty_logits_processors import FORCE_TOKEN, ForceTokenLogitsProcessor

    config = parse(["--logits-processors", FORCE_TOKEN]).create_engine_config()
    assert config.model_config.logits_processors == (FORCE_TOKEN,)
    # A class works as well as its name (LLM(logits_processors=[cls])).
    args = EngineArgs(logits_processors=[ForceTokenLogitsProcessor])
    assert args.create_engine_config().model_config.logits_processors == (
        ForceTokenLogitsProcessor,
    )
    for bad, why in [
        ("tests.engine_core.no_such_module:Processor", "cannot load"),
        ("tests.engine_core.faulty_logits_processors:NoSuchClass", "cannot load"),
        ("torch:Tensor", "not a subclass"),
        ("Processor", "is not 'package.module:Class'"),
    ]:
        with pytest.raises(ValueError, match=f"logits_processors: .*{why}"):
            EngineArgs(logits_processors=[bad]).create_engine_config()


def test_data_parallel_layout_is_validated_by_name() -> None:
    from kvserve.config.runtime import ParallelConfig

    with pytest.raises(ValueError, match="data_parallel_backend"):
        ParallelConfig(data_parallel_size=2, data_parallel_backend="slurm")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="data_parallel_size_local"):
        ParallelConfig(data_parallel_size=2, data_parallel_size_local=3)
    with pytest.raises(ValueError, match="data_parallel_start_rank"):
        ParallelConfig(data_parallel_size=2, data_parallel_size_local=2, data_parallel_start_rank=1)
    with pytest.raises(ValueError, match="data_parallel_rpc_port"):
        ParallelConfig(data_parallel_size=2, data_parallel_rpc_port=70000)
    # A headless node's ranks, and the Ray backend's (none spawned by the front end).
    node = ParallelConfig(
        data_parallel_size=4, data_parallel_size_local=2, data_parallel_start_rank=2
    )
    assert list(node.local_data_parallel_ranks) == [2, 3]
    assert not ParallelConfig(
        data_parallel_size=2, data_parallel_backend="ray"
    ).local_data_parallel_ranks
    # External load balancing: one rank's core alone, no DP client.
    config = EngineArgs(data_parallel_size=2, data_parallel_rank=1).create_engine_config()
    assert config.parallel_config.data_parallel_rank == 1
    assert not config.parallel_config.front_end_balances
    with pytest.raises(ValueError, match="data_parallel_rank"):
        EngineArgs(
            data_parallel_size=2, data_parallel_rank=1, data_parallel_backend="ray"
        ).create_engine_config()


def test_dual_batch_overlap_flags_reach_the_config_and_are_validated() -> None:
    config = parse(
        ["--enable-dbo", "--dbo-decode-token-threshold", "8", "--dbo-prefill-token-threshold", "64"]
    ).create_engine_config()
    parallel = config.parallel_config
    assert parallel.enable_dbo
    assert (parallel.dbo_decode_token_threshold, parallel.dbo_prefill_token_threshold) == (8, 64)
    assert not parse([]).enable_dbo  # off by default
    with pytest.raises(ValueError, match="dbo_decode_token_threshold"):
        EngineArgs(enable_dbo=True, dbo_decode_token_threshold=1).create_engine_config()
    with pytest.raises(ValueError, match=r"enable_dbo .*pipeline_parallel_size"):
        EngineArgs(enable_dbo=True, pipeline_parallel_size=2).create_engine_config()
    with pytest.raises(ValueError, match=r"enable_dbo .*speculative_config"):
        EngineArgs(
            enable_dbo=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        ).create_engine_config()
