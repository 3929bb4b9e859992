"""Intra-op threads for each model step, chosen by measured step time.

Every parallel region ends in a barrier, and the fused decode step (csrc/decode_step.cpp)
has six per layer. When other processes compete for the cores, a barrier waits until a
descheduled thread gets its next time slice, a few milliseconds each: on 2 cores with
load average 14, SmolLM2 decoded 1.1 tok/s with two threads and 9.5-11 with one. On a
quiet machine two threads are ~1.8x faster than one. Neither count is right everywhere,
so the runner measures: it runs an occasional step (a probe) with the other count and
keeps whichever is clearly faster for steps of that size.

Probes back off while they confirm the current choice (after 8 steps, doubling up to
every 1024), so on a steady machine they cost well under 1% of the steps. A step that
takes several times the usual time for its size, twice in a row, starts probing again
at once, weighed against those slow steps: that is how the onset (or the end) of
contention shows.

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
EMA_WEIGHT = 0.25  # of the newest step in each running mean


def _size_bucket(num_tokens: int) -> int:
    """Steps compared with each other: 1 token, 2-3, 4-7, ... (time grows with size)."""
    return max(1, num_tokens).bit_length()


class StepThreadGovernor:
    """Sets torch's intra-op threads before each step (``begin``) and learns from its
    elapsed time (``end``). Options: all ``max_threads`` or one."""

    def __init__(self, max_threads: int, enabled: bool = True) -> None:
        self.max_threads = max_threads
        self.enabled = enabled and max_threads > 1
        self.current = max_threads
        self._cost: dict[tuple[int, int], float] = {}  # (threads, bucket) -> mean seconds
        self._interval = FIRST_PROBE_AFTER
        self._until_probe = FIRST_PROBE_AFTER
        self._step: tuple[int, int, float] | None = None  # threads, bucket, start
        self._slow_steps: list[float] = []  # consecutive slow steps' times, current count

    @classmethod
    def for_process(cls) -> StepThreadGovernor:
        return cls(torch.get_num_threads(), os.environ.get(ENV_ADAPTIVE, "1") != "0")

    @property
    def other(self) -> int:
        return 1 if self.current > 1 else self.max_threads

    def begin(self, num_tokens: int) -> None:
        if not self.enabled:
            return
        bucket = _size_bucket(num_tokens)
        probing = self._until_probe <= 0 and (self.current, bucket) in self._cost
        threads = self.other if probing else self.current
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        self._step = (threads, bucket, time.perf_counter())

    def end(self) -> None:
        if self._step is None:
            return
        threads, bucket, start = self._step
        self._step = None
        elapsed = time.perf_counter() - start
        if threads != self.current:
            self._after_probe(threads, bucket, elapsed)
            return
        key = (threads, bucket)
        usual = self._cost.get(key)
        self._until_probe -= 1
        if usual is not None and elapsed > SLOWDOWN_FACTOR * usual:
            self._slow_steps.append(elapsed)
            if len(self._slow_steps) < SLOWDOWN_STEPS:
                return  # kept out of the mean until it proves to be a new regime
            # A new regime: the probe must be weighed against it (its fastest step, so a
            # hiccup among them does not decide), not against the old mean.
            self._cost[key] = min(self._slow_steps)
            self._slow_steps.clear()
            self._interval = FIRST_PROBE_AFTER
            self._until_probe = 0
            return
        self._slow_steps.clear()
        self._cost[key] = elapsed if usual is None else usual + EMA_WEIGHT * (elapsed - usual)

    def _after_probe(self, threads: int, bucket: int, elapsed: float) -> None:
        self._cost[(threads, bucket)] = elapsed
        current_cost = self._cost[(self.current, bucket)]
        if elapsed < SWITCH_MARGIN * current_cost:
            logger.info(
                "step threads %d -> %d: a %d-token step took %.1f ms against %.1f ms "
                "(other processes are %s the cores)",
                self.current, threads, 1 << (bucket - 1), 1e3 * elapsed, 1e3 * current_cost,
                "holding" if threads == 1 else "no longer holding",
            )  # fmt: skip
            self.current = threads
            self._slow_steps.clear()
            self._interval = FIRST_PROBE_AFTER
        else:
            self._interval = min(MAX_PROBE_INTERVAL, 2 * self._interval)
        self._until_probe = self._interval
