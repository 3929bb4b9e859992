"""Thread and OpenMP wait settings, chosen for the machine when a kvserve process starts.

OpenMP reads ``OMP_NUM_THREADS`` and its wait settings once, when torch loads its
runtime, so they must be in the environment before ``import torch``: the ``kvserve``
command sets them first thing, and the engine-core process gets them in the environment
it is spawned with. A value the user exported is always kept.

Choices: one OpenMP thread per core this process may run on (its CPU affinity, which
containers and ``taskset`` narrow, not the machine's core count). Where the process may
use only a few cores, workers that find no work spin for a bounded time and then sleep
(``GOMP_SPINCOUNT``, libgomp's knob, which torch's x86 builds use): the fused decode step
meets a barrier six times a layer (180 a token for SmolLM2) microseconds apart, and a
worker that slept at each (``OMP_WAIT_POLICY=PASSIVE``, the earlier choice) woke late: single
stream decode ran 50 against 70-78 tok/s offline, and a server 38-60 against 68-76 (one
stream) and 109-161 against 183-205 tok/s (8 streams), on 2 Ice Lake cores. The spin
ends a few milliseconds after the last step, so an idle server's workers sleep and the
front end keeps its core. On a larger machine ``ACTIVE`` (spinning) costs nothing the
front end needs. A value the user exported is kept, and with their own
``OMP_WAIT_POLICY`` kvserve sets no spin count.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from kvserve.utils.environ import environ_set

# Up to this many usable cores, idle workers spin briefly and then sleep (the front end
# shares the cores); above, they spin (OMP_WAIT_POLICY=ACTIVE).
BOUNDED_SPIN_MAX_CORES = 4
# libgomp's spin iterations before a waiting worker sleeps: ~5 ms on an Intel Xeon (a
# `pause` takes ~140 cycles), less on AMD; longer than the gaps between a busy engine's
# parallel regions and steps. 300,000 is libgomp's own default.
GOMP_SPIN_COUNT = "100000"
# omp_pause_resource_t: free the runtime's threads, keep its state.
OMP_PAUSE_SOFT = 1
# What configure_process_threads found before it set its own values.
_user_values: dict[str, str | None] = {}


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity API (macOS)
        return max(1, os.cpu_count() or 1)


def thread_settings(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The OpenMP environment a kvserve process should start with: the user's values
    where set, the machine's choices otherwise."""
    environ = os.environ if environ is None else environ
    cores = usable_cores()
    chosen = {"OMP_NUM_THREADS": str(cores)}
    if environ.get("OMP_WAIT_POLICY"):  # the user's policy, without our spin count over it
        chosen["OMP_WAIT_POLICY"] = environ["OMP_WAIT_POLICY"]
    elif cores <= BOUNDED_SPIN_MAX_CORES:
        chosen["GOMP_SPINCOUNT"] = GOMP_SPIN_COUNT
    else:
        chosen["OMP_WAIT_POLICY"] = "ACTIVE"
    return {key: environ.get(key) or value for key, value in chosen.items()}


def configure_process_threads() -> dict[str, str] | None:
    """Puts the settings into this process's environment and returns them; does nothing
    (None) once torch is loaded, as OpenMP would not see them (e.g. ``main()`` called
    inside a test process)."""
    if "torch" in sys.modules:
        return None
    settings = thread_settings()
    for key in settings:
        _user_values.setdefault(key, os.environ.get(key))
    os.environ.update(settings)
    return settings


def user_environment() -> dict[str, str]:
    """``os.environ`` as the user set it, without what configure_process_threads added:
    for starting processes that must choose for themselves (benchmarks of them)."""
    environ = dict(os.environ)
    for key, value in _user_values.items():
        if value is None:
            environ.pop(key, None)
        else:
            environ[key] = value
    return environ


@contextmanager
def child_thread_environment() -> Iterator[dict[str, str]]:
    """The settings in ``os.environ`` while a child process is started (spawned
    children copy the environment when they start), restored afterwards."""
    settings = thread_settings()
    with environ_set(settings):
        yield settings


def release_openmp_team() -> bool:
    """Ends the calling thread's OpenMP team, if it has one (its worker threads exit);
    the thread's next parallel region starts a new one. True where libgomp did it.

    libgomp keeps a team per thread that ever started a parallel region and counts
    their threads together: once they outnumber the cores, every barrier spins 1,000
    rounds instead of GOMP_SPINCOUNT and then sleeps. A thread handing its model to
    another (async scheduling's worker thread) ends its own team with this, or the
    other's barriers pay for it. OpenMP 5.0's omp_pause_resource_all(omp_pause_soft)
    does it; torch has no binding for it, so it is called in the libgomp torch loaded."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line}
    except OSError:  # not Linux: no libgomp to find
        return False
    for path in sorted(paths):
        pause = getattr(ctypes.CDLL(path), "omp_pause_resource_all", None)
        if pause is not None:
            return bool(pause(OMP_PAUSE_SOFT) == 0)
    return False
