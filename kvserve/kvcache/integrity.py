"""KVAuthenticator: a MAC over every KV value that leaves an engine, so that a peer who can
write to a shared tier (Redis, the cache server, shared storage, a P2P receiver, the
encoder cache) cannot make the engine compute from KV it never produced.

The MAC is keyed BLAKE3 (32 bytes) over the value's key, its header (dtype, shape and so
token count, serde) and its bytes, each framed with its length, so a valid value copied
under another key, or given another header, fails as surely as forged bytes. Keyed BLAKE3
runs at ~5 GiB/s on one core of the test machine, against 1.6 GiB/s for HMAC-SHA256 (with
SHA-NI) and 0.6 GiB/s for keyed BLAKE2b (1-4 MiB payloads; docs/kv_cache_tier.md).

The secret is the operator's: ``--kv-secret-file PATH`` or the environment variable
KVSERVE_KV_SECRET, the same on every engine that shares KV. Without one, KVAuthenticator
is the plain form (seal and open pass values through), and a tier that other processes or
hosts can write refuses to start unless ``--allow-unauthenticated-kv`` is given.

A value that fails its MAC is a miss for the caller, which counts it; the authenticator
logs it once per source, then at most once a minute with the count since.
"""

from __future__ import annotations

import hmac
import logging
import struct
import threading
import time
from collections.abc import Mapping

import blake3

from kvserve.config.kv_transfer import KVSecurityConfig
from kvserve.utils.kv_secret import (
    ENV_SECRET,
    KVSecurityError,
    check_secret_length,
    read_kv_secret,
)

logger = logging.getLogger(__name__)

Buffer = bytes | bytearray | memoryview

TAG_BYTES = 32
LOG_INTERVAL_S = 60.0
_CONTEXT = "kvserve 2025 KV integrity MAC v1"
_LEN = struct.Struct(">I")


class KVAuthenticator:
    """The plain form: no secret, values pass through unchanged. KeyedKVAuthenticator is
    the one that MACs; callers hold either and never test for a secret themselves."""

    authenticated = False

    def seal(self, key: str, header: bytes, payload: Buffer) -> Buffer:
        """The value to store or send for payload: payload followed by its MAC."""
        return payload

    def open(self, key: str, header: bytes, blob: Buffer, source: str) -> Buffer | None:
        """The payload of a sealed blob, or None when its MAC fails (logged per source)."""
        return blob

    def tag(self, key: str, header: bytes, payload: Buffer) -> bytes:
        """The MAC alone, for formats that carry it beside the payload (empty here)."""
        return b""

    def verify(self, key: str, header: bytes, payload: Buffer, tag: bytes, source: str) -> bool:
        return True


class KeyedKVAuthenticator(KVAuthenticator):
    authenticated = True

    def __init__(self, secret: bytes) -> None:
        check_secret_length(secret)
        self._key = blake3.blake3(secret, derive_key_context=_CONTEXT).digest()
        self._rejections = RejectionLog()

    def tag(self, key: str, header: bytes, payload: Buffer) -> bytes:
        raw_key = key.encode()
        mac = blake3.blake3(key=self._key)
        mac.update(_LEN.pack(len(raw_key)) + raw_key + _LEN.pack(len(header)) + header)
        mac.update(payload)
        return mac.digest()

    def verify(self, key: str, header: bytes, payload: Buffer, tag: bytes, source: str) -> bool:
        if hmac.compare_digest(self.tag(key, header, payload), tag):
            return True
        self._rejections.record(source, key)
        return False

    def seal(self, key: str, header: bytes, payload: Buffer) -> Buffer:
        blob = bytearray(payload)
        blob += self.tag(key, header, payload)
        return blob

    def open(self, key: str, header: bytes, blob: Buffer, source: str) -> Buffer | None:
        view = memoryview(blob).cast("B")
        if len(view) < TAG_BYTES:
            self._rejections.record(source, key)
            return None
        payload, tag = view[:-TAG_BYTES], bytes(view[-TAG_BYTES:])
        return payload if self.verify(key, header, payload, tag, source) else None


class RejectionLog:
    """Logs values that failed their MAC: the first from each source at once, later ones
    at most every LOG_INTERVAL_S seconds with how many came since (a planted tier can
    fail every chunk of every request)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # source -> (when last logged, failures not logged since)
        self._sources: dict[str, tuple[float, int]] = {}

    def record(self, source: str, key: str) -> None:
        now = time.monotonic()
        with self._lock:
            last, unlogged = self._sources.get(source, (-LOG_INTERVAL_S, 0))
            if now - last < LOG_INTERVAL_S:
                self._sources[source] = (last, unlogged + 1)
                return
            self._sources[source] = (now, 0)
        logger.warning(
            "KV from %s failed authentication (key %s%s): not loaded, recomputed. A peer "
            "wrote it without this engine's secret (a different --kv-secret-file, or none), "
            "or it was forged",
            source,
            key,
            f"; {unlogged} more since the last report" if unlogged else "",
        )


def read_secret(
    security: KVSecurityConfig, environ: Mapping[str, str] | None = None
) -> bytes | None:
    """The secret from the file, else the environment (utils/kv_secret.py)."""
    return read_kv_secret(security.kv_secret_file, environ)


def kv_authenticator(
    security: KVSecurityConfig, shared: str | None, environ: Mapping[str, str] | None = None
) -> KVAuthenticator:
    """The authenticator for KV kept in or sent through ``shared`` (a description of a
    store other processes or hosts can write, e.g. "the Redis tier redis://h:6379/0"), or
    in local-only tiers when shared is None. Without a secret a shared store is refused
    unless the operator opted out."""
    secret = read_secret(security, environ)
    if secret is not None:
        return KeyedKVAuthenticator(secret)
    if shared is not None and not security.allow_unauthenticated_kv:
        raise KVSecurityError(
            f"{shared} can be written by other processes or hosts, and KV read from it "
            "would be loaded unauthenticated: set a secret shared by every engine using it, "
            f"with --kv-secret-file PATH (or the environment variable {ENV_SECRET}), or pass "
            "--allow-unauthenticated-kv to accept KV that any writer of it can plant"
        )
    return PLAIN


PLAIN = KVAuthenticator()
