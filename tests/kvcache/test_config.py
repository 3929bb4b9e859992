from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.kvcache.config import (
    CacheConfigError,
    CacheEngineConfig,
    load_cache_engine_config,
    parse_size,
)


def test_defaults() -> None:
    cfg = load_cache_engine_config(environ={})
    assert cfg == CacheEngineConfig()
    assert cfg.chunk_size == 256 and cfg.local_cpu and cfg.local_disk is None


def test_precedence_yaml_over_env_over_extra_config(tmp_path: Path) -> None:
    path = tmp_path / "kv.yaml"
    path.write_text("chunk_size: 64\nmax_local_cpu_size: 32MiB\n")
    env = {
        "KVSERVE_CACHE_CONFIG": str(path),
        "KVSERVE_CACHE_CHUNK_SIZE": "128",
        "KVSERVE_CACHE_SAVE_UNFULL_CHUNK": "true",
        "KVSERVE_CACHE_REMOTE_URL": "redis://localhost:7000/2",
    }
    extra = {
        "chunk_size": 32,
        "save_unfull_chunk": False,
        "remote_serde": "int8",
        "local_disk": "file:///tmp/kv",
    }
    cfg = load_cache_engine_config(extra, environ=env)
    assert cfg.chunk_size == 64  # YAML wins over env and extra config
    assert cfg.max_local_cpu_size == 32 << 20
    assert cfg.save_unfull_chunk is True  # env wins over extra config
    assert cfg.remote_url == "redis://localhost:7000/2"
    assert cfg.remote_serde == "int8"  # only extra config set it
    assert cfg.local_disk == "/tmp/kv"
    # The kv_cache_config key (what --kv-cache-config sets) names the YAML file too.
    cfg2 = load_cache_engine_config({"kv_cache_config": str(path)}, environ={})
    assert cfg2.chunk_size == 64


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"chunk_sise": 4}, "did you mean 'chunk_size'"),
        ({"chunk_size": 0}, "chunk_size must be >= 1"),
        ({"chunk_size": "many"}, "bad value for chunk_size"),
        ({"max_local_cpu_size": "12 parsecs"}, "bad value for max_local_cpu_size"),
        ({"remote_url": "http://x:1"}, "redis:// or kvserve://"),
        ({"remote_url": "redis://host"}, "host:port"),
        ({"remote_url": "redis://h:1/x"}, "db must be an integer"),
        ({"remote_serde": "int2-zstd"}, "remote_serde must be one of"),
        ({"local_disk_serde": "lz4"}, "local_disk_serde must be one of"),
        ({"local_cpu": "maybe"}, "not a boolean"),
        ({"blocking_timeout_secs": 0}, "blocking_timeout_secs must be > 0"),
    ],
)
def test_clear_errors(extra: dict, message: str) -> None:
    with pytest.raises(CacheConfigError, match=message):
        load_cache_engine_config(extra, environ={})


@pytest.mark.parametrize("name", ["zstd", "int8-zstd", "int4-zstd"])
def test_compressed_serdes_are_accepted_for_every_tier(name: str) -> None:
    env = {"KVSERVE_CACHE_LOCAL_DISK_SERDE": name}
    cfg = load_cache_engine_config({"remote_serde": name, "local_cpu_serde": name}, environ=env)
    assert (cfg.local_cpu_serde, cfg.local_disk_serde, cfg.remote_serde) == (name,) * 3


def test_errors_name_their_source(tmp_path: Path) -> None:
    with pytest.raises(CacheConfigError, match="KVSERVE_CACHE_CHUNK_SIZE"):
        load_cache_engine_config(environ={"KVSERVE_CACHE_CHUNK_SIZE": "x"})
    bad = tmp_path / "bad.yaml"
    bad.write_text("[1, 2")
    with pytest.raises(CacheConfigError, match="not valid YAML"):
        load_cache_engine_config(config_file=str(bad), environ={})
    with pytest.raises(CacheConfigError, match="cannot read"):
        load_cache_engine_config(config_file=str(tmp_path / "missing.yaml"), environ={})


def test_sizes() -> None:
    assert parse_size(1024) == 1024
    assert parse_size("64MiB") == 64 << 20
    assert parse_size("2GB") == 2_000_000_000
    assert parse_size(0.5) == 500_000_000  # a float is GB, as in LMCache
    assert parse_size("1.5") == 1_500_000_000
