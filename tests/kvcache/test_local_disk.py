from __future__ import annotations

import time
from pathlib import Path

import torch

from kvserve.kvcache.stats import CacheStats
from kvserve.kvcache.storage.disk_store import MAGIC
from kvserve.kvcache.storage.local_disk import LocalDiskBackend
from tests.kvcache.helpers import CHUNK_BYTES, key, kv


def _disk(path: Path, max_bytes: int = 1 << 30, **kw: object) -> LocalDiskBackend:
    return LocalDiskBackend(str(path), max_bytes, CacheStats(), **kw)  # type: ignore[arg-type]


def _files(path: Path) -> list[Path]:
    return sorted(path.glob("*.kvc"))


def test_round_trip_and_restart(tmp_path: Path) -> None:
    disk = _disk(tmp_path)
    for i in range(3):
        disk.put(key(i), kv(i))
    disk.flush()
    assert len(_files(tmp_path)) == 3
    assert all(f.read_bytes()[:4] == MAGIC for f in _files(tmp_path))
    disk.close()
    # A new process (a new backend) finds the chunks by rescanning the directory.
    again = _disk(tmp_path)
    assert again.contains(key(1))
    assert torch.equal(again.get(key(1)), kv(1))
    assert again.used_bytes == sum(f.stat().st_size for f in _files(tmp_path))
    again.close()


def test_corrupt_and_truncated_files_are_misses_and_removed(tmp_path: Path) -> None:
    disk = _disk(tmp_path)
    for i in range(3):
        disk.put(key(i), kv(i))
    disk.flush()
    by_size = {f: f.stat().st_size for f in _files(tmp_path)}
    files = list(by_size)
    # Flip one payload byte, truncate another, garble a third's header.
    data = bytearray(files[0].read_bytes())
    data[-10] ^= 0xFF
    files[0].write_bytes(data)
    with open(files[1], "r+b") as f:
        f.truncate(by_size[files[1]] // 2)
    with open(files[2], "r+b") as f:
        f.seek(12)
        f.write(b"\xc1\xc1\xc1\xc1")
    for i in range(3):
        assert disk.get(key(i)) is None
    assert _files(tmp_path) == []
    assert disk.used_bytes == 0
    assert disk.stats.tier("disk").errors == 3  # each is an error as well as a miss
    disk.close()


def test_restart_drops_garbage_and_temp_files(tmp_path: Path) -> None:
    disk = _disk(tmp_path)
    disk.put(key(0), kv(0))
    disk.close()
    (tmp_path / "deadbeef.kvc").write_bytes(b"not a chunk")
    (tmp_path / ".tmp-1-2-x.kvc").write_bytes(b"half written")
    again = _disk(tmp_path)
    assert [f.name for f in tmp_path.iterdir()] == [_files(tmp_path)[0].name]
    assert torch.equal(again.get(key(0)), kv(0))
    again.close()


def test_bound_holds_and_lru_evicts(tmp_path: Path) -> None:
    bound = 8 * (CHUNK_BYTES + 200)
    disk = _disk(tmp_path, bound)
    for i in range(40):  # 5x the bound
        disk.put(key(i), kv(i))
        disk.flush()
        on_disk = sum(f.stat().st_size for f in _files(tmp_path))
        assert on_disk <= bound
    assert disk.get(key(0)) is None and torch.equal(disk.get(key(39)), kv(39))
    disk.close()


def test_writes_are_off_the_request_path(tmp_path: Path) -> None:
    disk = _disk(tmp_path)
    big = torch.randn(8, 2, 256, 16, 64)  # 32 MiB
    t0 = time.perf_counter()
    disk.put(key(0), big)
    put_s = time.perf_counter() - t0
    disk.flush()
    total_s = time.perf_counter() - t0
    # put() only queues the chunk; checksum and write happen on the writer thread.
    assert put_s < total_s / 3, (put_s, total_s)
    assert disk.contains(key(0)) and torch.equal(disk.get(key(0)), big)
    disk.close()
