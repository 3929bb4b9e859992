"""The encoder cache connector (vLLM's ECConnector): encoder outputs in a tier that engine
instances share, so an image one instance encoded is loaded, not encoded, by the others.

Separate from the KV connectors: it moves an item's encoder output (its soft-token
embeddings), keyed by the item's content hash and the model, never KV blocks. The worker
asks it before running the vision tower and hands it every output it computes. The
tiers are kvcache's storage backends (a disk directory or Redis), whose formats carry
shape, dtype and a checksum: nothing is unpickled, a damaged entry is a miss. Both tiers are
written by other instances, so entries are sealed with the KV secret (a MAC over the key,
header and bytes; kvserve.kvcache.integrity) and one that fails it is a miss; without a
secret the connector refuses to start unless the operator allowed unauthenticated KV.
"""

from __future__ import annotations

import logging
import urllib.parse

import torch

from kvserve.config import ECTransferConfig, KVSecurityConfig
from kvserve.kvcache.integrity import kv_authenticator
from kvserve.kvcache.key import CacheEngineKey
from kvserve.kvcache.stats import CacheStats
from kvserve.kvcache.storage.base import StorageBackend
from kvserve.kvcache.storage.local_disk import LocalDiskBackend

logger = logging.getLogger(__name__)

# The disk tier's bound; encoder outputs are small (tokens x hidden floats per image).
_DISK_BYTES = 8 << 30


class ECConnector:
    """Loads and saves one model's encoder outputs by item hash."""

    def __init__(
        self, config: ECTransferConfig, model_name: str, security: KVSecurityConfig
    ) -> None:
        self.model_name = model_name
        self.stats = CacheStats()
        self.backend: StorageBackend
        where = config.ec_storage_path if config.ec_connector == "disk" else config.ec_redis_url
        auth = kv_authenticator(security, f"the encoder cache's {config.ec_connector} {where}")
        if config.ec_connector == "disk":
            assert config.ec_storage_path is not None
            self.backend = LocalDiskBackend(
                config.ec_storage_path, _DISK_BYTES, self.stats, auth=auth
            )
        else:
            # Imported only for it: the redis client costs every engine ~0.1 s of start-up.
            from kvserve.kvcache.storage.redis_backend import RedisBackend

            assert config.ec_redis_url is not None
            url = urllib.parse.urlsplit(config.ec_redis_url)
            db = int(url.path.lstrip("/") or 0)
            self.backend = RedisBackend(
                url.hostname or "localhost", url.port or 6379, db, self.stats, auth=auth
            )

    def _key(self, mm_hash: str) -> CacheEngineKey:
        # The tag keeps encoder outputs apart from KV chunks in a tier both use.
        return CacheEngineKey(self.model_name, 1, 0, mm_hash, "encoder", (("kind", "encoder"),))

    def load(self, mm_hash: str, device: torch.device) -> torch.Tensor | None:
        tensor = self.backend.get(self._key(mm_hash))
        return None if tensor is None else tensor.to(device)

    def save(self, mm_hash: str, output: torch.Tensor) -> None:
        self.backend.put(self._key(mm_hash), output.detach().cpu().contiguous())
        # Written through: another instance may look for it right after this step.
        self.backend.flush(timeout=10.0)

    def close(self) -> None:
        self.backend.close()
