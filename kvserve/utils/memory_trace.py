"""Python heap snapshots over time, per process, for finding what keeps growing.

With KVSERVE_TRACEMALLOC_DIR set, every kvserve process (the API server, the engine core,
each worker: spawned children inherit the variable) starts tracemalloc, keeping
KVSERVE_TRACEMALLOC_FRAMES frames per allocation (default 8), and writes a snapshot to
that directory every KVSERVE_TRACEMALLOC_INTERVAL seconds (default 60), named
``<role>-<pid>-<seconds since start>.snap``. `kvserve bench memdiff DIR` then compares,
per process, the first snapshot after a warm-up with the last and lists the allocation
sites that grew.

tracemalloc sees what goes through Python's allocators: objects, and the buffers of
bytes, numpy arrays and msgspec. Tensor storage that torch allocates itself, and memory
glibc keeps in its arenas after a free, are invisible to it: compare its totals with the
resident memory `kvserve bench soak` reports. Tracing slows Python code down by about
a factor of two; it is for a profiling run, not for serving.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import tracemalloc

logger = logging.getLogger(__name__)

DIR_ENV = "KVSERVE_TRACEMALLOC_DIR"
INTERVAL_ENV = "KVSERVE_TRACEMALLOC_INTERVAL"
FRAMES_ENV = "KVSERVE_TRACEMALLOC_FRAMES"


def start_from_env(role: str) -> bool:
    """Starts tracing and the snapshot thread when DIR_ENV is set; whether it did."""
    directory = os.environ.get(DIR_ENV)
    if not directory:
        return False
    interval_s = float(os.environ.get(INTERVAL_ENV, "60"))
    frames = int(os.environ.get(FRAMES_ENV, "8"))
    if interval_s <= 0 or frames < 1:
        raise ValueError(f"{INTERVAL_ENV} must be > 0 and {FRAMES_ENV} >= 1")
    os.makedirs(directory, exist_ok=True)
    if not tracemalloc.is_tracing():
        tracemalloc.start(frames)
    thread = threading.Thread(
        target=_snapshot_loop,
        args=(directory, role, interval_s),
        name="tracemalloc-snapshots",
        daemon=True,
    )
    thread.start()
    logger.warning(
        "tracemalloc on (%d frames): snapshots every %g s in %s", frames, interval_s, directory
    )
    return True


def _snapshot_loop(directory: str, role: str, interval_s: float) -> None:
    start = time.monotonic()
    pid = os.getpid()
    while True:
        time.sleep(interval_s)
        elapsed = round(time.monotonic() - start)
        path = os.path.join(directory, f"{role}-{pid}-{elapsed:06d}.snap")
        # Written under another name first: a reader never sees half a snapshot.
        tracemalloc.take_snapshot().dump(path + ".tmp")
        os.replace(path + ".tmp", path)
