"""The C allocator of kvserve's children (utils/allocator.py) and the scheduled trims of
glibc's heap (utils/heap_trim.py), in real spawned interpreters and the real C library."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from multiprocessing.connection import Connection

import pytest

from kvserve.utils.allocator import (
    ALLOCATOR_ENV,
    allocator_choice,
    child_allocator_environment,
    child_preload,
    jemalloc_library,
    running_allocator,
)
from kvserve.utils.heap_trim import HeapTrimmer
from kvserve.utils.processes import pipe, spawn, stop, wait_for_handshake


def _report_allocator(writer: Connection) -> None:
    with open("/proc/self/maps") as maps:
        mapped = "libjemalloc" in maps.read()
    released_mib = _freed_then_trimmed() / 2**20
    writer.send_bytes(f"{running_allocator()} {mapped} {released_mib:.0f}".encode())


def _child_allocator() -> str:
    reader, writer = pipe()
    proc = spawn(_report_allocator, (writer,), "AllocatorReport")
    writer.close()
    try:
        return wait_for_handshake(reader, proc, 120, "allocator child").decode()
    finally:
        stop([proc])


def test_make_install_provides_jemalloc() -> None:
    # The Makefile installs Debian's libjemalloc2: without it the default is glibc's
    # malloc, whose resident memory grows under mixed traffic (docs/robustness.md).
    assert jemalloc_library() is not None, "make install installs libjemalloc2"


def _mapped_and_released(report: str) -> tuple[str, str, int]:
    allocator, mapped, released_mib = report.split()
    return allocator, mapped, int(released_mib)


def test_children_run_on_jemalloc_by_default_and_trims_purge_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(ALLOCATOR_ENV, raising=False)
    before = {key: os.environ.get(key) for key in ("LD_PRELOAD", "MALLOC_CONF")}
    allocator, mapped, released_mib = _mapped_and_released(_child_allocator())
    assert (allocator, mapped) == ("jemalloc", "True")
    assert released_mib > 0.8 * CHUNK * COUNT / 2**20
    # Only the child's environment changed.
    assert {key: os.environ.get(key) for key in before} == before
    assert running_allocator() == "glibc"  # the test process itself was not re-exec'd


def test_glibc_on_request_and_then_trims_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ALLOCATOR_ENV, "glibc")
    assert child_preload() is None
    allocator, mapped, released_mib = _mapped_and_released(_child_allocator())
    assert (allocator, mapped) == ("glibc", "False")
    assert released_mib > 0.8 * CHUNK * COUNT / 2**20


def test_a_preload_the_user_set_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    library = jemalloc_library()
    assert library is not None
    monkeypatch.setenv("LD_PRELOAD", library)
    monkeypatch.setenv("MALLOC_CONF", "narenas:2")
    assert child_preload() is None  # already preloaded: nothing added
    with child_allocator_environment():
        assert os.environ["LD_PRELOAD"] == library
        assert os.environ["MALLOC_CONF"] == "narenas:2"
    assert _child_allocator().startswith("jemalloc True ")


def test_an_unknown_allocator_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ALLOCATOR_ENV, "tcmalloc")
    with pytest.raises(ValueError, match="KVSERVE_ALLOCATOR must be one of auto, jemalloc"):
        allocator_choice()
    with pytest.raises(ValueError, match=ALLOCATOR_ENV):
        _child_allocator()


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


CHUNK, COUNT = 96 * 1024, 2048  # 192 MiB


def _freed_then_trimmed() -> int:
    """Bytes one trim gave back after 192 MiB were allocated, touched and freed. Chunks
    this size come from glibc's heap, and the last, freed only after the trim, pins the
    heap's top: glibc cannot shrink it on free(). jemalloc, as kvserve configures it,
    keeps freed pages until a purge."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    chunks = [libc.malloc(CHUNK) for _ in range(COUNT)]
    for chunk in chunks:
        ctypes.memset(chunk, 1, CHUNK)
    for chunk in chunks[:-1]:
        libc.free(chunk)
    held = _resident_bytes()
    trimmer = HeapTrimmer(interval_s=3600)
    assert trimmer.enabled
    trimmer.after_work()  # within the interval: no trim yet
    assert trimmer.num_trims == 0
    trimmer.before_idle()  # idle after work: trims
    assert trimmer.num_trims == 1
    released = held - _resident_bytes()
    libc.free(chunks[-1])
    trimmer.before_idle()  # no work since: nothing to do
    assert trimmer.num_trims == 1
    return released


def test_a_trim_returns_freed_heap_memory_that_glibc_keeps() -> None:
    assert running_allocator() == "glibc"
    released = _freed_then_trimmed()
    assert released > 0.8 * CHUNK * COUNT, f"released {released / 2**20:.0f} MiB"


def test_trims_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_MALLOC_TRIM_INTERVAL", "0")
    trimmer = HeapTrimmer()
    trimmer.after_work()
    trimmer.before_idle()
    assert not trimmer.enabled and trimmer.num_trims == 0


def test_a_process_executes_itself_again_on_jemalloc_keeping_pid_and_arguments() -> None:
    code = (
        "import os, sys\n"
        "from kvserve.utils.allocator import exec_on_jemalloc, running_allocator\n"
        "print('started', running_allocator(), flush=True)\n"
        "exec_on_jemalloc()\n"
        "print(os.getpid(), running_allocator(), sys.argv[1:])\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", ALLOCATOR_ENV)}
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "serve", "--port", "1"],
        stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    assert stdout.splitlines() == [
        "started glibc",
        "started jemalloc",  # the same program again, from the top
        f"{proc.pid} jemalloc ['serve', '--port', '1']",
    ]
