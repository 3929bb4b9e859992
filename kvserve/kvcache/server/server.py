"""CacheServer: `kvserve cache-server`, a small asyncio TCP store for KV chunks.

Values live in memory up to max_bytes (payload bytes), least recently used evicted first;
with a spill directory, evicted chunks go to a DiskStore and are still served from there.
The server must outlive bad clients: a malformed header or an over-cap length gets an error
reply and the connection is closed; a half-closed or stalled connection is dropped; the
other connections and the stored chunks are untouched.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import OrderedDict
from typing import Any

from kvserve.kvcache.serde import ChunkMeta
from kvserve.kvcache.server.wire import (
    LENGTH,
    MAX_HEADER_BYTES,
    ProtocolError,
    decode_header,
    encode_frame,
)
from kvserve.kvcache.storage.disk_store import DiskStore

logger = logging.getLogger(__name__)

MAX_KEY_CHARS = 4096


class CacheServer:
    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        max_bytes: int = 1 << 30,
        max_payload_bytes: int | None = None,
        spill_dir: str | None = None,
        max_spill_bytes: int = 10 << 30,
        frame_timeout: float = 30.0,
        auth_token: str | None = None,
    ) -> None:
        self.host, self.port = host, port
        # Every connection's first request must be an AUTH with this token.
        self._token = None if auth_token is None else auth_token.encode()
        self.auth_failures = 0
        self.max_bytes = max_bytes
        # No single value may be larger than memory (or the explicit cap, if smaller).
        self.max_payload_bytes = min(max_payload_bytes or max_bytes, max_bytes)
        self.frame_timeout = frame_timeout
        self.spill = DiskStore(spill_dir, max_spill_bytes) if spill_dir else None
        self._entries: OrderedDict[str, tuple[ChunkMeta, bytes]] = OrderedDict()
        self.used_bytes = 0
        self.peak_bytes = 0
        self._server: asyncio.base_events.Server | None = None
        self.protocol_errors = 0

    async def start(self) -> tuple[str, int]:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        host, port = self._server.sockets[0].getsockname()[:2]
        self.port = port
        return host, port

    async def serve_forever(self) -> None:
        assert self._server is not None
        async with self._server:
            await self._server.serve_forever()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    # -- connections ---------------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        authenticated = self._token is None
        try:
            while True:
                try:
                    prefix = await reader.readexactly(LENGTH.size)
                except asyncio.IncompleteReadError:
                    break  # the client closed (or half-closed) between or inside frames
                (header_len,) = LENGTH.unpack(prefix)
                try:
                    if header_len > MAX_HEADER_BYTES:
                        raise ProtocolError(f"header of {header_len} bytes exceeds the cap")
                    raw = await asyncio.wait_for(reader.readexactly(header_len), self.frame_timeout)
                    header = decode_header(raw)
                    if not authenticated:
                        # Refused before any payload is read: no memory for strangers.
                        self._authenticate(header)
                        authenticated = True
                        writer.write(encode_frame({"status": "ok"}))
                        await writer.drain()
                        continue
                    if header["len"] > self.max_payload_bytes:
                        raise ProtocolError(
                            f"payload of {header['len']} bytes exceeds the cap of "
                            f"{self.max_payload_bytes}"
                        )
                    payload = (
                        await asyncio.wait_for(
                            reader.readexactly(header["len"]), self.frame_timeout
                        )
                        if header["len"]
                        else b""
                    )
                except ProtocolError as exc:
                    # After a bad frame the stream cannot be resynchronised: reply and close.
                    self.protocol_errors += 1
                    writer.write(encode_frame({"status": "error", "error": str(exc)}))
                    await writer.drain()
                    break
                reply, body = await self._dispatch(header, payload)
                writer.write(encode_frame(reply, len(body)))
                if body:
                    writer.write(body)
                await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            pass  # a truncated frame, a stalled client, or a reset: drop just this connection
        except Exception:
            logger.exception("cache server connection failed")
        finally:
            writer.close()
            try:
                await writer.wait_closed()
            except (ConnectionError, OSError):
                pass

    def _authenticate(self, header: dict[str, Any]) -> None:
        token = header.get("token")
        assert self._token is not None
        if (
            header.get("op") == "AUTH"
            and isinstance(token, str)
            and secrets.compare_digest(token.encode(), self._token)
        ):
            return
        self.auth_failures += 1
        raise ProtocolError("unauthenticated: the first request must be AUTH with the token")

    async def _dispatch(
        self, header: dict[str, Any], payload: bytes
    ) -> tuple[dict, bytes | memoryview]:
        op = header.get("op")
        if op == "AUTH":  # again, or to a server without a token: nothing to change
            return {"status": "ok"}, b""
        if op == "HEALTH":
            return self.health(), b""
        key = header.get("key")
        if not isinstance(key, str) or not key or len(key) > MAX_KEY_CHARS:
            return {"status": "error", "error": "a non-empty string key is required"}, b""
        if op == "PUT":
            try:
                meta = ChunkMeta.from_dict(header.get("meta"))
            except ValueError as exc:
                return {"status": "error", "error": f"bad meta: {exc}"}, b""
            await self._put(key, meta, payload)
            return {"status": "ok"}, b""
        if op == "GET":
            found = await self._get(key)
            if found is None:
                return {"status": "miss"}, b""
            meta, value = found
            return {"status": "ok", "meta": meta.to_dict()}, value
        if op == "EXISTS":
            exists = key in self._entries or (self.spill is not None and self.spill.contains(key))
            return {"status": "ok", "exists": exists}, b""
        if op == "DELETE":
            self._drop(key)
            if self.spill is not None:
                await asyncio.to_thread(self.spill.remove, key)
            return {"status": "ok"}, b""
        return {"status": "error", "error": f"unknown op {op!r}"}, b""

    # -- the store -----------------------------------------------------------------------

    def _drop(self, key: str) -> tuple[ChunkMeta, bytes] | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.used_bytes -= len(entry[1])
        return entry

    async def _put(self, key: str, meta: ChunkMeta, payload: bytes) -> None:
        self._drop(key)
        evicted: list[tuple[str, ChunkMeta, bytes]] = []
        while self.used_bytes + len(payload) > self.max_bytes and self._entries:
            old_key, (old_meta, old_value) = self._entries.popitem(last=False)
            self.used_bytes -= len(old_value)
            evicted.append((old_key, old_meta, old_value))
        self._entries[key] = (meta, payload)
        self.used_bytes += len(payload)
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        if self.spill is not None and evicted:
            spill = self.spill
            await asyncio.to_thread(lambda: [spill.write(k, m, v) for k, m, v in evicted])

    async def _get(self, key: str) -> tuple[ChunkMeta, bytes | memoryview] | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            return entry
        if self.spill is not None:
            return await asyncio.to_thread(self.spill.read, key)
        return None

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "used_bytes": self.used_bytes,
            "peak_bytes": self.peak_bytes,
            "max_bytes": self.max_bytes,
            "keys": len(self._entries),
            "spill_bytes": self.spill.used_bytes if self.spill is not None else 0,
            "protocol_errors": self.protocol_errors,
        }
