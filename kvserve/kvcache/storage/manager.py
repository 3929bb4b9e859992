"""StorageManager: the ordered tiers (CPU -> disk -> remote) behind one get/put.

put is write-through: every tier gets the chunk (the disk tier queues it off the request
path). get asks tier by tier and promotes a hit from a lower tier into the CPU tier, so the
next get is a memory hit.
"""

from __future__ import annotations

import torch

from kvserve.kvcache.config import CacheEngineConfig, parse_remote_url
from kvserve.kvcache.integrity import PLAIN, KVAuthenticator
from kvserve.kvcache.key import CacheEngineKey
from kvserve.kvcache.stats import CacheStats
from kvserve.kvcache.storage.base import StorageBackend
from kvserve.kvcache.storage.local_cpu import LocalCPUBackend
from kvserve.kvcache.tier_events import TierEventSink
from kvserve.utils.secret_file import read_secret_file


def create_backends(
    config: CacheEngineConfig, stats: CacheStats, auth: KVAuthenticator = PLAIN
) -> list[StorageBackend]:
    """The tiers config turns on; disk and remote values are sealed with auth (the CPU
    tier's stay in this process's memory, where a MAC would guard nothing)."""
    backends: list[StorageBackend] = []
    if config.local_cpu and config.max_local_cpu_size > 0:
        backends.append(LocalCPUBackend(config.max_local_cpu_size, stats, config.local_cpu_serde))
    if config.local_disk:
        from kvserve.kvcache.storage.local_disk import LocalDiskBackend

        backends.append(
            LocalDiskBackend(
                config.local_disk,
                config.max_local_disk_size,
                stats,
                config.local_disk_serde,
                auth=auth,
            )
        )
    if config.remote_url:
        scheme, host, port, db = parse_remote_url(config.remote_url)
        token_file = config.remote_auth_token_file
        common = {
            "serde_name": config.remote_serde,
            "timeout": config.blocking_timeout_secs,
            "reconnect_interval": config.remote_reconnect_interval_secs,
            "auth_token": (
                None
                if token_file is None
                else read_secret_file(token_file, "remote_auth_token_file")
            ),
            "auth": auth,
        }
        if scheme == "redis":
            from kvserve.kvcache.storage.redis_backend import RedisBackend

            backends.append(RedisBackend(host, port, db, stats, **common))  # type: ignore[arg-type]
        else:
            from kvserve.kvcache.storage.cache_server_backend import CacheServerBackend

            backends.append(CacheServerBackend(host, port, stats, **common))  # type: ignore[arg-type]
    return backends


class StorageManager:
    def __init__(self, backends: list[StorageBackend]) -> None:
        self.backends = backends
        self.cpu: LocalCPUBackend | None = next(
            (b for b in backends if isinstance(b, LocalCPUBackend)), None
        )

    def attach_events(self, sink: TierEventSink) -> None:
        """Every tier tells ``sink`` what it gains and drops from now on."""
        for backend in self.backends:
            backend.events = sink

    def by_medium(self, medium: str) -> StorageBackend:
        """The tier of that kind (cpu, disk, remote); ValueError naming the ones there are."""
        for backend in self.backends:
            if backend.medium == medium:
                return backend
        there = ", ".join(b.medium for b in self.backends) or "none"
        raise ValueError(f"tier: no {medium!r} tier here (tiers: {there})")

    def put(self, key: CacheEngineKey, kv: torch.Tensor) -> None:
        """Writes key to every tier that lacks it (a remote tier that was down and came
        back is refilled by the next store of the same chunk)."""
        owned: torch.Tensor | None = None
        for backend in self.backends:
            if backend.contains(key):
                continue
            if owned is None:
                # One owned, contiguous CPU copy, shared read-only by every tier.
                owned = kv.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)
            backend.put(key, owned)

    def contains(self, key: CacheEngineKey) -> StorageBackend | None:
        """The first tier that holds key, or None."""
        for backend in self.backends:
            if backend.contains(key):
                return backend
        return None

    def get(self, key: CacheEngineKey) -> torch.Tensor | None:
        for backend in self.backends:
            kv = backend.get(key)
            if kv is None:
                continue
            if self.cpu is not None and backend is not self.cpu:
                self.cpu.put(key, kv)
            return kv
        return None

    def promote(self, key: CacheEngineKey) -> bool:
        """Brings key into the CPU tier if a lower tier holds it (for prefetch)."""
        if self.cpu is None or self.cpu.contains(key):
            return self.cpu is not None
        return self.get(key) is not None

    def remove(self, key: CacheEngineKey) -> None:
        for backend in self.backends:
            backend.remove(key)

    def flush(self, timeout: float | None = None) -> None:
        for backend in self.backends:
            backend.flush(timeout)

    def clear(self, include_remote: bool = False) -> None:
        from kvserve.kvcache.storage.local_disk import LocalDiskBackend

        for backend in self.backends:
            if include_remote or isinstance(backend, LocalCPUBackend | LocalDiskBackend):
                backend.clear()

    def health(self) -> dict[str, bool]:
        return {backend.name: backend.health() for backend in self.backends}

    def close(self) -> None:
        for backend in self.backends:
            backend.close()
