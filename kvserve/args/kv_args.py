"""The engine arguments of KV that leaves the engine (vLLM's names where vLLM has them):
KV cache events, the KV connector and the tiered cache, and the secret that
authenticates them; their CLI flags, and the configs they make."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

from kvserve.config import KVEventsConfig, KVSecurityConfig, KVTransferConfig


@dataclass
class KVArgs:
    # A KVEventsConfig, a dict of its fields, or the JSON text of --kv-events-config.
    kv_events_config: KVEventsConfig | dict[str, Any] | str | None = None
    # A KVTransferConfig, a dict of its fields, or the JSON text of --kv-transfer-config.
    kv_transfer_config: KVTransferConfig | dict[str, Any] | str | None = None
    # YAML file of the tiered KV cache; on its own it turns on TieredCacheConnector.
    kv_cache_config: str | None = None
    # The MAC secret of KV that leaves the engine (else env KVSERVE_KV_SECRET), and the
    # opt-out that lets a shared store run without one (docs/kv_cache_tier.md#security).
    kv_secret_file: str | None = None
    allow_unauthenticated_kv: bool = False

    def _events_config(self) -> KVEventsConfig | None:
        if self.kv_events_config is None:
            return None
        return KVEventsConfig.from_cli(self.kv_events_config)

    def _security_config(self) -> KVSecurityConfig:
        return KVSecurityConfig(self.kv_secret_file, self.allow_unauthenticated_kv)

    def _transfer_config(self) -> KVTransferConfig | None:
        transfer = (
            None
            if self.kv_transfer_config is None
            else KVTransferConfig.from_cli(self.kv_transfer_config)
        )
        if self.kv_cache_config is None:
            return transfer
        if transfer is None:
            transfer = KVTransferConfig(kv_connector="TieredCacheConnector")
        extra = {**transfer.kv_connector_extra_config, "kv_cache_config": self.kv_cache_config}
        return dataclasses.replace(transfer, kv_connector_extra_config=extra)


def add_kv_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("KV events, connectors and the KV cache tier")
    group.add_argument(
        "--kv-events-config",
        default=None,
        help='KV cache events as JSON, e.g. \'{"enable_kv_cache_events": true, '
        '"endpoint": "tcp://10.0.0.5:5557"}\' (default endpoint tcp://127.0.0.1:5557: '
        "the events carry prompts' token ids, so other hosts are let in by address only)",
    )
    group.add_argument(
        "--kv-transfer-config",
        default=None,
        help='KV connector as JSON, e.g. \'{"kv_connector": "SharedStorageConnector", '
        '"kv_role": "kv_both", "kv_connector_extra_config": '
        '{"shared_storage_path": "/tmp/kv"}}\'',
    )
    group.add_argument(
        "--kv-cache-config",
        default=None,
        help="YAML file configuring the tiered KV cache (CPU, disk, Redis, cache server); "
        "enables TieredCacheConnector unless --kv-transfer-config names another connector",
    )
    group.add_argument(
        "--kv-secret-file", default=None, metavar="PATH",
        help="file holding the secret that authenticates (MACs) KV leaving the engine: "
        "tiers, P2P transfers, the encoder cache; every engine sharing KV needs the same "
        "(default: the environment variable KVSERVE_KV_SECRET)",
    )  # fmt: skip
    group.add_argument(
        "--allow-unauthenticated-kv", action="store_true",
        help="let Redis, the cache server, shared storage and P2P run without a KV "
        "secret: KV any writer of them plants is then loaded",
    )  # fmt: skip
