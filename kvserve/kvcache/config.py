"""CacheEngineConfig: the KV tier's settings, from YAML, environment and connector config.

Sources, highest precedence first (a key set in a higher source wins):

1. a YAML file: the path in `kv_cache_config` (the `--kv-cache-config` flag puts it
   there) or else in the environment variable KVSERVE_CACHE_CONFIG;
2. environment variables KVSERVE_CACHE_<KEY> (e.g. KVSERVE_CACHE_CHUNK_SIZE=128);
3. keys of `kv_connector_extra_config` (the engine's --kv-transfer-config JSON).

Sizes are bytes given as an int, a string with a unit ("64MiB", "2GB", "512KB"), or a float
meaning GB as in LMCache ("max_local_cpu_size: 5.0" is 5 GB). Unknown keys are errors.

Each tier has its serde (local_cpu_serde, local_disk_serde, remote_serde), one of SERDES;
bytes per token of SmolLM2-135M's float32 KV (46080 raw) in brackets:

- raw: the tensor's bytes, exact (46080);
- int8: per token and head, symmetric, uncompressed (12240; relative error 0.011);
- zstd: byte-shuffled and zstd-coded, exact (about 38400);
- int8-zstd: 8-bit per channel over each chunk's tokens, zstd-coded (about 11700;
  relative error 0.003 K / 0.005 V);
- int4-zstd: 4-bit likewise (about 5700; relative error 0.05 K / 0.08 V; only 37% of
  greedy tokens agree with recompute on SmolLM2: capacity over fidelity).

The quantized ones keep every element within half a quantization step of its channel
(kvserve/kvcache/zstd_serde.py); the zstd ones carry checksums, so a damaged value is a
miss even without a KV secret. int8-zstd or int4-zstd suit a remote tier where the network
costs more than the decode (docs/kv_cache_tier.md, "Serdes").
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import urlparse

import yaml

ENV_PREFIX = "KVSERVE_CACHE_"
ENV_CONFIG_FILE = "KVSERVE_CACHE_CONFIG"
CONFIG_FILE_KEY = "kv_cache_config"
# How a tier stores chunks (kvserve/kvcache/serde.py): raw and int8 uncompressed; zstd
# lossless, int8-zstd and int4-zstd quantized per channel, then zstd-coded.
SERDES = ("raw", "int8", "zstd", "int8-zstd", "int4-zstd")
GB = 1_000_000_000

_UNITS = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
}


class CacheConfigError(ValueError):
    """A KV tier setting is missing, unknown or has a bad value; the message names its source."""


@dataclass
class CacheEngineConfig:
    chunk_size: int = 256
    local_cpu: bool = True
    max_local_cpu_size: int = 5 * GB
    local_cpu_serde: str = "raw"
    # A directory (or file:// URL); None disables the disk tier.
    local_disk: str | None = None
    max_local_disk_size: int = 5 * GB
    local_disk_serde: str = "raw"
    # redis://host:port/db or kvserve://host:port; None disables the remote tier.
    remote_url: str | None = None
    remote_serde: str = "raw"
    # A file holding the remote store's secret: the cache server's token (its
    # --auth-token-file) or Redis's password (AUTH).
    remote_auth_token_file: str | None = None
    save_unfull_chunk: bool = False
    save_decode_cache: bool = False
    # Bound on every blocking remote operation; past it the operation is a miss.
    blocking_timeout_secs: float = 5.0
    # After a remote failure, operations are misses until this many seconds have passed.
    remote_reconnect_interval_secs: float = 1.0
    hash_seed: int = 0
    enable_async_loading: bool = False
    # A cache controller's view of this tier (kvserve cache-controller): tier events
    # (stored / removed per tier) published on this ZMQ PUB endpoint, and pin / unpin /
    # clear / move served on this one; each rank binds the port plus its rank. Both bind
    # where they say (loopback unless configured); None: off.
    tier_events_endpoint: str | None = None
    control_endpoint: str | None = None
    # CacheBlend (LMCache's names): prompts split at the separator into segments whose KV
    # is stored and found by content alone, whatever their position; a request that
    # reuses them recomputes blend_recompute_ratio of their tokens (lossy below 1.0).
    enable_blending: bool = False
    blend_special_str: str = " # # "
    # The separator as comma-separated token ids (a model without a tokenizer); overrides
    # blend_special_str.
    blend_separator_ids: str | None = None
    blend_recompute_ratio: float = 0.15
    # The layer after which only the selected tokens are computed (LMCache's check layer).
    blend_check_layer: int = 1

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.chunk_size < 1:
            raise CacheConfigError(f"chunk_size must be >= 1, got {self.chunk_size}")
        for name in ("max_local_cpu_size", "max_local_disk_size"):
            if getattr(self, name) < 0:
                raise CacheConfigError(f"{name} must be >= 0 bytes, got {getattr(self, name)}")
        for name in ("local_cpu_serde", "local_disk_serde", "remote_serde"):
            if getattr(self, name) not in SERDES:
                raise CacheConfigError(
                    f"{name} must be one of {SERDES}, got {getattr(self, name)!r}"
                )
        if self.blocking_timeout_secs <= 0:
            raise CacheConfigError(
                f"blocking_timeout_secs must be > 0, got {self.blocking_timeout_secs}"
            )
        if self.remote_reconnect_interval_secs < 0:
            raise CacheConfigError("remote_reconnect_interval_secs must be >= 0")
        if self.local_disk is not None and self.local_disk.startswith("file://"):
            self.local_disk = urlparse(self.local_disk).path
        if self.local_disk == "":
            self.local_disk = None
        if self.remote_url == "":
            self.remote_url = None
        if self.remote_url is not None:
            parse_remote_url(self.remote_url)
        if not 0.0 <= self.blend_recompute_ratio <= 1.0:
            raise CacheConfigError(
                f"blend_recompute_ratio must be in [0, 1], got {self.blend_recompute_ratio}"
            )
        if self.blend_check_layer < 0:
            raise CacheConfigError(f"blend_check_layer must be >= 0, got {self.blend_check_layer}")
        if self.blend_separator_ids is not None:
            self.blend_separator_token_ids()
        elif not self.blend_special_str:
            raise CacheConfigError("blend_special_str must not be empty")

    def blend_separator_token_ids(self) -> list[int] | None:
        """blend_separator_ids parsed (None: tokenize blend_special_str)."""
        if self.blend_separator_ids is None:
            return None
        try:
            ids = [int(part) for part in self.blend_separator_ids.split(",") if part.strip()]
        except ValueError as exc:
            raise CacheConfigError(
                f"blend_separator_ids must be comma-separated token ids, got "
                f"{self.blend_separator_ids!r}"
            ) from exc
        if not ids or min(ids) < 0:
            raise CacheConfigError(
                f"blend_separator_ids must name one or more token ids >= 0, got "
                f"{self.blend_separator_ids!r}"
            )
        return ids


def parse_remote_url(url: str) -> tuple[str, str, int, int]:
    """(scheme, host, port, db) of redis://host:port/db or kvserve://host:port."""
    parsed = urlparse(url)
    if parsed.scheme not in ("redis", "kvserve"):
        raise CacheConfigError(f"remote_url must start with redis:// or kvserve://, got {url!r}")
    try:
        port = parsed.port
    except ValueError as exc:
        raise CacheConfigError(f"remote_url has a bad port: {url!r}") from exc
    if not parsed.hostname or port is None:
        raise CacheConfigError(f"remote_url needs host:port, got {url!r}")
    path = parsed.path.strip("/")
    if parsed.scheme == "redis":
        if path and not path.isdigit():
            raise CacheConfigError(f"remote_url's Redis db must be an integer, got {url!r}")
        return parsed.scheme, parsed.hostname, port, int(path or 0)
    if path:
        raise CacheConfigError(f"a kvserve:// remote_url takes no path, got {url!r}")
    return parsed.scheme, parsed.hostname, port, 0


def parse_size(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError("a size cannot be a boolean")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value * GB)
    text = str(value).strip().lower().replace(" ", "")
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([a-z]*)", text)
    if not match:
        raise ValueError(f"not a size: {value!r}")
    number, unit = match.groups()
    if not unit:
        return int(number) if number.isdigit() else int(float(number) * GB)
    if unit not in _UNITS:
        raise ValueError(f"unknown size unit {unit!r} (use B, KB, MB, GB, KiB, MiB, GiB)")
    return int(float(number) * _UNITS[unit])


def _parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {value!r}")


def _convert(name: str, value: Any) -> Any:
    if name.startswith("max_") and name.endswith("_size"):
        return parse_size(value)
    kind = _FIELD_TYPES[name]
    if kind == "bool":
        return _parse_bool(value)
    if kind == "int":
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError(f"not an integer: {value!r}")
        return int(value)
    if kind == "float":
        return float(value)
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null")):
        return None
    return str(value)


# "int", "bool", "float" or "str" (the first word of each annotation; "str | None" -> "str").
_FIELD_TYPES = {f.name: str(f.type).split(" ")[0] for f in fields(CacheEngineConfig)}


def _apply(values: dict[str, Any], source: str, raw: Mapping[str, Any]) -> None:
    for name, value in raw.items():
        if name not in _FIELD_TYPES:
            hint = difflib.get_close_matches(name, list(_FIELD_TYPES), n=1)
            extra = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise CacheConfigError(f"{source}: unknown KV cache key {name!r}{extra}")
        if name in values:
            continue  # a higher-precedence source already set it
        try:
            values[name] = _convert(name, value)
        except (TypeError, ValueError) as exc:
            raise CacheConfigError(f"{source}: bad value for {name}: {exc}") from exc


def load_cache_engine_config(
    extra_config: Mapping[str, Any] | None = None,
    config_file: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> CacheEngineConfig:
    """Merges the three sources (see the module docstring) and validates the result."""
    env = os.environ if environ is None else environ
    extra = dict(extra_config or {})
    path = config_file or extra.pop(CONFIG_FILE_KEY, None) or env.get(ENV_CONFIG_FILE)
    extra.pop(CONFIG_FILE_KEY, None)
    values: dict[str, Any] = {}
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                data = yaml.safe_load(f) or {}
        except OSError as exc:
            raise CacheConfigError(f"cannot read KV cache config file {path!r}: {exc}") from exc
        except yaml.YAMLError as exc:
            raise CacheConfigError(
                f"KV cache config file {path!r} is not valid YAML: {exc}"
            ) from exc
        if not isinstance(data, dict):
            raise CacheConfigError(f"KV cache config file {path!r} must hold a mapping")
        _apply(values, f"config file {path}", data)
    env_values = {
        k[len(ENV_PREFIX) :].lower(): v
        for k, v in env.items()
        if k.startswith(ENV_PREFIX) and k != ENV_CONFIG_FILE
    }
    for name, value in env_values.items():
        _apply(values, f"environment variable {ENV_PREFIX}{name.upper()}", {name: value})
    _apply(values, "kv_connector_extra_config", extra)
    try:
        return CacheEngineConfig(**values)
    except TypeError as exc:
        raise CacheConfigError(str(exc)) from exc
