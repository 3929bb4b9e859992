"""Intra-op threads for each model step, chosen by measured step time.

Every parallel region ends in a barrier, and the fused decode step (csrc/decode_step.cpp)
has six per layer. When other processes compete for the cores, a barrier waits until a
descheduled thread gets its next time slice, a few milliseconds each: on 2 cores with
load average 14, SmolLM2 decoded 1.1 tok/s with two threads and 9.5-11 with one. On a
quiet machine two threads are ~1.8x faster than one. Neither count is right everywhere,
so the runner measures: it runs an occasional step (a probe) with the other count and
keeps whichever is clearly faster for steps of that size.

Each size bucket has its own choice and its own probe schedule. Sizes differ in what a
second thread buys: a batched decode step that reads every sequence's KV cache is bound
by memory (read rate 23.8 / 26.4 GB/s at one / two threads on a 2-core Zen 4), the single
stream's step gains ~1.8x. With one choice for every size, one thread chosen during a
batch carried over to the single stream after it, and the probe interval the batch's
steps had backed off (up to 1,024 steps) kept it there: `bench peers` ran workload c
after a and b at 60-72 tok/s, against 110-116 alone. A size not probed yet runs with
the nearest probed size's choice (contention slows them all, and a loaded machine's
two-thread step can take ten times its one-thread one) until its own first probe, 8
steps in.

Probes back off while they confirm a size's choice (after 8 steps, doubling up to every
1024), so on a steady machine they cost well under 1% of the steps. A step that takes
several times the usual time for its size, twice in a row, starts probing again at
once, weighed against those slow steps: that is how the onset of contention shows. Its
end shows on one thread as steps clearly faster than usual, twice in a row: they probe
all threads at once too (once between two scheduled probes), instead of waiting out an
interval that the contended probes had backed off.

``KVSERVE_ADAPTIVE_THREADS=0`` keeps torch's thread count for every step.
"""

from __future__ import annotations

import logging
import os
import time

import torch

logger = logging.getLogger(__name__)

ENV_ADAPTIVE = "KVSERVE_ADAPTIVE_THREADS"
FIRST_PROBE_AFTER = 8
MAX_PROBE_INTERVAL = 1024
# Switch only to a count at most this share of the current one's step time: noise between
# two probes must not flip a quiet machine's choice (one thread there costs ~1.8x).
SWITCH_MARGIN = 0.75
# Steps this many times their size's usual time, this many in a row, mean the machine
# changed: probe now. A single slow step is not enough: one 140 ms hiccup in a stream of
# 5 ms steps (a quiet AMD EPYC) made the probe's 8 ms one-thread step look 17x faster,
# and the engine then decoded on one thread at half speed until a later probe (up to
# 1,024 steps) undid it. Contention by other processes lasts far longer than two steps.
SLOWDOWN_FACTOR = 3.0
SLOWDOWN_STEPS = 2
# On one thread (chosen while other processes held the cores), steps this many times
# faster than usual, this many in a row, mean the contention may have ended: probe all
# threads now, not at a backed-off probe up to 1,024 steps away. Once between two
# scheduled probes: under lasting contention a false alarm's probe is a two-thread step,
# up to 10x a one-thread one.
SPEEDUP_FACTOR = 1.5
SPEEDUP_STEPS = 2
EMA_WEIGHT = 0.25  # of the newest step in each running mean


def _size_bucket(num_tokens: int) -> int:
    """Steps compared with each other: 1 token, 2-3, 4-7, ... (time grows with size)."""
    return max(1, num_tokens).bit_length()


class _SizeState:
    """What the governor knows about steps of one size bucket."""

    def __init__(self, bucket: int, threads: int) -> None:
        self.bucket = bucket
        self.threads = threads  # the count its steps run with
        self.cost: dict[int, float] = {}  # threads -> mean seconds of a step
        self.seen: set[int] = set()  # thread counts that ran a step of this size
        self.probed = False  # its own choice; until then it follows the nearest size's
        self.interval = FIRST_PROBE_AFTER
        self.until_probe = FIRST_PROBE_AFTER
        self.slow_steps: list[float] = []  # consecutive slow steps' times, current count
        self.fast_steps: list[float] = []  # consecutive fast steps' times, on one thread
        self.speedup_may_probe = True  # no speed-up probe since the last scheduled one


class StepThreadGovernor:
    """Sets torch's intra-op threads before each step (``begin``) and learns from its
    elapsed time (``end``). Options: all ``max_threads`` or one, chosen per size bucket."""

    def __init__(self, max_threads: int, enabled: bool = True) -> None:
        self.max_threads = max_threads
        self.enabled = enabled and max_threads > 1
        self._sizes: dict[int, _SizeState] = {}
        self._step: tuple[_SizeState, int, float] | None = None  # size, threads, start

    @classmethod
    def for_process(cls) -> StepThreadGovernor:
        return cls(torch.get_num_threads(), os.environ.get(ENV_ADAPTIVE, "1") != "0")

    def threads_for(self, num_tokens: int) -> int:
        """The thread count the next step of this many tokens runs with, probes aside."""
        bucket = _size_bucket(num_tokens)
        size = self._sizes.get(bucket)
        return size.threads if size is not None and size.probed else self._guess(bucket)

    def _guess(self, bucket: int) -> int:
        """For a size not probed yet: the choice of the nearest probed size (contention
        slows every size), all threads where there is none."""
        probed = [s for s in self._sizes.values() if s.probed]
        if not probed:
            return self.max_threads
        return min(probed, key=lambda s: (abs(s.bucket - bucket), s.bucket)).threads

    def _other(self, size: _SizeState) -> int:
        return 1 if size.threads > 1 else self.max_threads

    def begin(self, num_tokens: int) -> None:
        if not self.enabled:
            return
        bucket = _size_bucket(num_tokens)
        size = self._sizes.get(bucket)
        if size is None:
            size = self._sizes[bucket] = _SizeState(bucket, self.max_threads)
        if not size.probed and size.threads != (guess := self._guess(bucket)):
            size.threads = guess
            size.slow_steps.clear()
            size.fast_steps.clear()
        probing = size.until_probe <= 0 and size.threads in size.cost
        threads = self._other(size) if probing else size.threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        self._step = (size, threads, time.perf_counter())

    def end(self) -> None:
        if self._step is None:
            return
        size, threads, start = self._step
        self._step = None
        elapsed = time.perf_counter() - start
        if threads != size.threads:
            self._after_probe(size, threads, elapsed)
            return
        size.until_probe -= 1
        if size.until_probe == 0:  # a scheduled probe is next
            size.speedup_may_probe = True
        if threads not in size.seen:
            # A size's first step pays one-time costs (buffers, pages, the first decode's
            # lazy set-up: 1.7-2.0 s against ~30 ms steps after it, load 8-12), which a mean
            # would carry into the first probe's comparison.
            size.seen.add(threads)
            return
        usual = size.cost.get(threads)
        if usual is not None and elapsed > SLOWDOWN_FACTOR * usual:
            size.slow_steps.append(elapsed)
            if len(size.slow_steps) < SLOWDOWN_STEPS:
                return  # kept out of the mean until it proves to be a new regime
            # A new regime: the probe must be weighed against it (its fastest step, so a
            # hiccup among them does not decide), not against the old mean.
            size.cost[threads] = min(size.slow_steps)
            size.slow_steps.clear()
            size.speedup_may_probe = True
            size.interval = FIRST_PROBE_AFTER
            size.until_probe = 0
            return
        size.slow_steps.clear()
        if (
            threads < self.max_threads
            and size.speedup_may_probe
            and usual is not None
            and SPEEDUP_FACTOR * elapsed < usual
        ):
            size.fast_steps.append(elapsed)
            if len(size.fast_steps) < SPEEDUP_STEPS:
                return  # kept out of the mean, as a slow step is
            # Weighed against the fast steps (the slowest of them), as a slowdown is.
            size.cost[threads] = max(size.fast_steps)
            size.fast_steps.clear()
            size.speedup_may_probe = False
            size.until_probe = 0
            return
        size.fast_steps.clear()
        size.cost[threads] = elapsed if usual is None else usual + EMA_WEIGHT * (elapsed - usual)

    def _after_probe(self, size: _SizeState, threads: int, elapsed: float) -> None:
        size.probed = True
        size.cost[threads] = elapsed
        current_cost = size.cost[size.threads]
        if elapsed < SWITCH_MARGIN * current_cost:
            logger.info(
                "step threads %d -> %d for %d+ token steps: one took %.1f ms against %.1f ms "
                "(other processes are %s the cores)",
                size.threads, threads, 1 << (size.bucket - 1),
                1e3 * elapsed, 1e3 * current_cost,
                "holding" if threads == 1 else "no longer holding",
            )  # fmt: skip
            size.threads = threads
            size.slow_steps.clear()
            size.fast_steps.clear()
            size.speedup_may_probe = True
            size.interval = FIRST_PROBE_AFTER
        else:
            size.interval = min(MAX_PROBE_INTERVAL, 2 * size.interval)
        size.until_probe = size.interval
