"""Freed heap memory handed back to the OS on a schedule: glibc's malloc_trim, or a purge
of jemalloc's arenas.

A serving process frees as much as it allocates, yet its resident memory climbs for hours
under glibc: it keeps freed chunks in its arenas (one per thread that allocates, and
torch's intra-op threads do) and gives pages back on its own only from the top of the
main heap. Tensors of a new size every step (prefill chunks of every length, batches of
every size) leave holes that later allocations rarely fill exactly, so the arenas' free
memory only grows. ``malloc_trim(0)`` releases every whole free page of every arena
(madvise; the address space stays reserved), typically in a few milliseconds.

kvserve serve's processes run on jemalloc where the machine has it (utils/allocator.py),
set to keep freed pages instead of returning them on its decay timer: returning them while
busy costs a page fault per page on the next step's tensors (docs/robustness.md).
There the trim purges every arena (``arena.<all>.purge``), so pages go back to the OS
when the process goes idle, and at the same bounded rate while busy.

HeapTrimmer trims when its process goes idle after work, and at most every
KVSERVE_MALLOC_TRIM_INTERVAL seconds while busy (default 30; 0 turns trimming off). Where
the C library has neither (musl, macOS), it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import time
from collections.abc import Callable

from kvserve.utils.allocator import running_allocator

logger = logging.getLogger(__name__)

INTERVAL_ENV = "KVSERVE_MALLOC_TRIM_INTERVAL"
DEFAULT_INTERVAL_S = 30.0


# jemalloc's MALLCTL_ARENAS_ALL: the pseudo-index naming every arena.
_ALL_ARENAS = 4096


def _load_trim() -> Callable[[], object] | None:
    if running_allocator() == "jemalloc":
        mallctl = ctypes.CDLL(None).mallctl
        mallctl.restype = ctypes.c_int
        command = f"arena.{_ALL_ARENAS}.purge".encode()
        return lambda: mallctl(command, None, None, None, ctypes.c_size_t(0))
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        malloc_trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    malloc_trim.argtypes = [ctypes.c_size_t]
    malloc_trim.restype = ctypes.c_int
    return lambda: malloc_trim(0)


def interval_from_env() -> float:
    value = os.environ.get(INTERVAL_ENV)
    interval = DEFAULT_INTERVAL_S if value in (None, "") else float(value)
    if interval < 0:
        raise ValueError(f"{INTERVAL_ENV} must be >= 0 (0: off), got {value}")
    return interval


class HeapTrimmer:
    """Call ``after_work()`` after each unit of work and ``before_idle()`` before blocking."""

    def __init__(self, interval_s: float | None = None) -> None:
        self.interval_s = interval_from_env() if interval_s is None else interval_s
        self._trim = _load_trim() if self.interval_s > 0 else None
        self._last = time.monotonic()
        self._worked = False
        # For the logs and the tests: how often it ran and for how long in all.
        self.num_trims = 0
        self.seconds = 0.0

    @property
    def enabled(self) -> bool:
        return self._trim is not None

    def after_work(self) -> None:
        self._worked = True
        if self._trim is not None and time.monotonic() - self._last >= self.interval_s:
            self.trim()

    def before_idle(self) -> None:
        if self._worked and self._trim is not None:
            self.trim()

    def trim(self) -> None:
        if self._trim is None:
            return
        start = time.monotonic()
        self._trim()
        self._last = time.monotonic()
        self._worked = False
        self.num_trims += 1
        self.seconds += self._last - start
        if self.num_trims % 100 == 1:
            logger.debug(
                "heap trim: %d trims, %.1f ms on average",
                self.num_trims,
                1000 * self.seconds / self.num_trims,
            )
