"""DiskStore: one file per chunk in a directory, bounded in bytes, evicted least recently used.

File layout (all integers big-endian):

    b"KVSC" | version u16 | header length u32 | msgpack header | payload

The header holds key (its string form), shape, dtype, serde, payload_len and crc32 of the
payload. Files are written to a temporary name and renamed into place, so a reader sees a
whole file or none. A file that is short, has a bad header or a bad checksum is a miss and
is removed. On start the directory is rescanned (headers only), so chunks survive restarts.
Used by LocalDiskBackend and by the cache server's disk spill.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import threading
import zlib
from collections import OrderedDict
from pathlib import Path

import msgspec

from kvserve.kvcache.serde import Buffer, ChunkMeta
from kvserve.kvcache.storage.pins import PinCounts

logger = logging.getLogger(__name__)

MAGIC = b"KVSC"
VERSION = 1
_PREFIX = struct.Struct(">4sHI")
_MAX_HEADER = 1 << 16
SUFFIX = ".kvc"


def file_name(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest() + SUFFIX


def _read_header(f: object, path: Path) -> tuple[dict, int]:
    """(header, offset of the payload); raises ValueError on anything malformed."""
    prefix = f.read(_PREFIX.size)  # type: ignore[attr-defined]
    if len(prefix) != _PREFIX.size:
        raise ValueError("truncated prefix")
    magic, version, header_len = _PREFIX.unpack(prefix)
    if magic != MAGIC or version != VERSION or header_len > _MAX_HEADER:
        raise ValueError(f"bad magic/version/header length in {path.name}")
    raw = f.read(header_len)  # type: ignore[attr-defined]
    if len(raw) != header_len:
        raise ValueError("truncated header")
    header = msgspec.msgpack.decode(raw)
    if not isinstance(header, dict) or not isinstance(header.get("key"), str):
        raise ValueError("header is not a map with a key")
    for name in ("payload_len", "crc32"):
        if not isinstance(header.get(name), int):
            raise ValueError(f"header lacks {name}")
    return header, _PREFIX.size + header_len


class DiskStore:
    def __init__(self, directory: str | os.PathLike[str], max_bytes: int) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        # key string -> file size in bytes, in LRU order (oldest first)
        self._files: OrderedDict[str, int] = OrderedDict()
        self._pins: PinCounts[str] = PinCounts()
        self.used_bytes = 0
        self.evictions = 0
        # Keys evicted since the last take_evicted() (the backend reports them).
        self._evicted_keys: list[str] = []
        self.corrupt_reads = 0  # files that failed their checks on read (then removed)
        self.write_errors = 0  # writes the OS refused (disk full, RLIMIT_FSIZE, ...)
        self._rescan()

    def _rescan(self) -> None:
        found: list[tuple[float, str, int]] = []
        for path in self.dir.iterdir():
            if path.name.startswith(".tmp-"):
                path.unlink(missing_ok=True)  # a write interrupted by a crash
                continue
            if path.suffix != SUFFIX:
                continue
            try:
                with open(path, "rb") as f:
                    header, _ = _read_header(f, path)
                st = path.stat()
                if path.name != file_name(header["key"]):
                    raise ValueError("file name does not match its key")
                found.append((st.st_mtime, header["key"], st.st_size))
            except (OSError, ValueError, msgspec.DecodeError) as exc:
                logger.warning("removing unreadable KV chunk file %s: %s", path, exc)
                path.unlink(missing_ok=True)
        for _, key, size in sorted(found):
            self._files[key] = size
            self.used_bytes += size
        self._evict(0)

    def _path(self, key: str) -> Path:
        return self.dir / file_name(key)

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._files

    def pin(self, key: str) -> bool:
        with self._lock:
            if key not in self._files:
                return False
            self._pins.add(key)
            return True

    def unpin(self, key: str) -> None:
        with self._lock:
            self._pins.release(key)

    def _evict(self, incoming: int) -> int:
        """Removes cold unpinned files until `incoming` more bytes fit (under self._lock)."""
        evicted = 0
        for key in list(self._files):
            if self.used_bytes + incoming <= self.max_bytes:
                break
            if key in self._pins:
                continue
            self.used_bytes -= self._files.pop(key)
            self._path(key).unlink(missing_ok=True)
            self._evicted_keys.append(key)
            evicted += 1
        self.evictions += evicted
        return evicted

    def take_evicted(self) -> list[str]:
        """The keys evicted since the last call."""
        with self._lock:
            keys, self._evicted_keys = self._evicted_keys, []
        return keys

    def write(self, key: str, meta: ChunkMeta, payload: Buffer) -> int:
        """Writes one chunk file; returns its size, or 0 when it does not fit or the OS
        refuses the write (counted in write_errors; no partial file is left behind)."""
        header = msgspec.msgpack.encode(
            {
                **meta.to_dict(),
                "key": key,
                "payload_len": len(payload),
                "crc32": zlib.crc32(payload),
            }
        )
        size = _PREFIX.size + len(header) + len(payload)
        with self._lock:
            if key in self._files:
                self._files.move_to_end(key)
                return 0
            self._evict(size)
            if self.used_bytes + size > self.max_bytes:
                return 0
            # Reserve the space now so concurrent writers cannot overshoot the bound.
            self._files[key] = size
            self.used_bytes += size
        tmp = self.dir / f".tmp-{os.getpid()}-{threading.get_ident()}-{file_name(key)}"
        try:
            with open(tmp, "wb") as f:
                f.write(_PREFIX.pack(MAGIC, VERSION, len(header)))
                f.write(header)
                f.write(payload)
            os.replace(tmp, self._path(key))
        except OSError as exc:
            logger.warning("KV disk write failed for %s: %s", key, exc)
            tmp.unlink(missing_ok=True)
            self._forget(key)
            with self._lock:
                self.write_errors += 1
            return 0
        return size

    def read(self, key: str) -> tuple[ChunkMeta, memoryview] | None:
        with self._lock:
            if key not in self._files:
                return None
            self._files.move_to_end(key)
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                header, _ = _read_header(f, path)
                if header["key"] != key:
                    raise ValueError("file holds another key")
                meta = ChunkMeta.from_dict(header)
                buf = bytearray(header["payload_len"])
                got = f.readinto(buf)
                if got != len(buf) or f.read(1):
                    raise ValueError("payload length does not match the header")
            if zlib.crc32(buf) != header["crc32"]:
                raise ValueError("checksum mismatch")
        except (OSError, ValueError, msgspec.DecodeError) as exc:
            logger.warning("KV chunk file %s unreadable (%s); treating as a miss", path, exc)
            self.remove(key)
            with self._lock:
                self.corrupt_reads += 1
            return None
        return meta, memoryview(buf)

    def _forget(self, key: str) -> None:
        with self._lock:
            size = self._files.pop(key, None)
            if size is not None:
                self.used_bytes -= size
            self._pins.discard(key)

    def remove(self, key: str) -> None:
        self._forget(key)
        self._path(key).unlink(missing_ok=True)

    def clear(self) -> None:
        with self._lock:
            keys = list(self._files)
        for key in keys:
            self.remove(key)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._files)
