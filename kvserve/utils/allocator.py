"""The C allocator kvserve's serving processes run on: jemalloc where the machine has it.

Under glibc's malloc a serving process's resident memory climbs for hours although it
frees all it allocates (measured in docs/robustness.md, "Memory over hours"): tensors of
a new size every step leave holes in glibc's per-thread arenas that later allocations
rarely fill exactly, so freed memory stays resident, and ``malloc_trim`` lowers the level
without stopping the climb. jemalloc sorts allocations into size classes, so the same
traffic holds a flat level; utils/heap_trim.py purges its free pages on the same
schedule as glibc's trims. A jemalloc heap profile of that traffic found no live
allocation growing: the growth was all allocator retention.

A process cannot switch its allocator once running, so the choice is made where a
process starts: ``spawn`` starts kvserve's children (the engine core and the TP/PP
workers, where the tensors live) with libjemalloc preloaded, and ``kvserve serve``
executes itself again with it before it does anything else (the API server's heap also
grew under glibc, 0.5 MiB a minute). ``KVSERVE_ALLOCATOR`` picks:
``auto`` (default) jemalloc when its library is found, else glibc with scheduled trims;
``jemalloc`` the same, but an error when the library is missing; ``glibc`` the C
library's own malloc. A ``LD_PRELOAD`` the user set already is kept, ahead of ours.
``make install`` installs Debian's ``libjemalloc2``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

from kvserve.utils.environ import environ_set

ALLOCATOR_ENV = "KVSERVE_ALLOCATOR"
CHOICES = ("auto", "jemalloc", "glibc")

# Freed pages stay with jemalloc until HeapTrimmer purges them (idle, or every 30 s while
# busy). Its default decay returns them continuously instead, and every page returned
# while serving is faulted in again by the next step's tensors: with the defaults the
# engine core took 1.7 million page faults in 30 s of serving (glibc: 0.06-0.4 million)
# and served 7% fewer tokens per second; with decay off and the scheduled purges, 22
# thousand and glibc's speed (docs/robustness.md).
# Kept as set when the user configured jemalloc through MALLOC_CONF themselves.
JEMALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1"

_SEARCH_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/lib",
)


def allocator_choice() -> str:
    value = os.environ.get(ALLOCATOR_ENV, "") or "auto"
    if value not in CHOICES:
        raise ValueError(f"{ALLOCATOR_ENV} must be one of {', '.join(CHOICES)}, got {value!r}")
    return value


@cache
def jemalloc_library() -> str | None:
    """The path of libjemalloc.so.2 on this machine, or None."""
    for directory in _SEARCH_DIRS:
        path = Path(directory) / "libjemalloc.so.2"
        if path.is_file():
            return str(path)
    name = ctypes.util.find_library("jemalloc")
    if name is None:
        return None
    try:  # find_library gives a bare soname: resolve it to the file the loader would map
        ctypes.CDLL(name)
    except OSError:
        return None
    return name


def child_preload() -> str | None:
    """The library a spawned child should preload, per KVSERVE_ALLOCATOR; None: glibc."""
    choice = allocator_choice()
    if choice == "glibc" or os.environ.get("LD_PRELOAD", "").find("jemalloc") >= 0:
        return None
    library = jemalloc_library()
    if library is None and choice == "jemalloc":
        raise ValueError(
            f"{ALLOCATOR_ENV}=jemalloc but no libjemalloc.so.2 was found; install it "
            "(Debian/Ubuntu: apt-get install libjemalloc2) or set it to auto or glibc"
        )
    return library


@contextmanager
def child_allocator_environment() -> Iterator[None]:
    """os.environ as a child spawned inside it should inherit it: with jemalloc
    preloaded (and configured) where KVSERVE_ALLOCATOR and the machine allow."""
    library = child_preload()
    if library is None:
        yield
        return
    preload = os.environ.get("LD_PRELOAD")
    values = {"LD_PRELOAD": f"{preload}:{library}" if preload else library}
    if not os.environ.get("MALLOC_CONF"):
        values["MALLOC_CONF"] = JEMALLOC_CONF
    with environ_set(values):
        yield


def exec_on_jemalloc() -> None:
    """Replaces this process by itself (same pid, same arguments) running on jemalloc,
    where KVSERVE_ALLOCATOR and the machine allow and it does not already; else returns.
    Only for a process that has started nothing yet: a command-line entry point."""
    if running_allocator() == "jemalloc" or child_preload() is None:
        return
    with child_allocator_environment():
        environ = dict(os.environ)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environ)


def running_allocator() -> str:
    """'jemalloc' when this process's malloc is jemalloc's, else 'glibc'."""
    return "jemalloc" if hasattr(ctypes.CDLL(None), "mallctl") else "glibc"
