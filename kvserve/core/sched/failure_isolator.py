"""FailureIsolator: finding the request a failed step is due to, by bisection over preemption.

A step that raises (a custom logits processor's bug, a kernel rejecting one request's
input) does not say which of its requests caused it. The scheduler finds out:

- A failed step with a single request is that request's: it ends with finish reason
  "error", its blocks freed (*attributed*).
- A failed step with several preempts them all by recompute, the tested path that a
  shortage of blocks takes, and makes them *suspects*. Their blocks that the step was
  filling leave the prefix cache first: the step may have stopped halfway through writing
  them. The next step is empty, so the workers drop every row of the failed batch
  (including per-row state the failure may have left half updated) and take the
  requests back later as resumed from preemption.
- From then on each step runs only the *probe*: the first half of the failed set, or once
  that is settled, the first half of the remaining suspects. Everything else waits, a few
  steps (about log2(n) per culprit). A probe member that samples in a step that succeeds
  is cleared and goes on as if nothing had happened: a greedy request produces exactly the
  tokens it would have; a seeded one too, unless the failed step had drawn from its
  generator before raising. A failing probe is halved again, down to a single request.
  Should no probe member be able to run (no free blocks, a KV load pending), the round is
  given up and scheduling goes on as usual.

The engine core dies only on failures no request could be blamed for: a round of
suspects that ends without a culprit (a transient fault, or requests that fail only
together), or a failed step that ran no request. `consecutive_unattributed_failures`
counts them; a step that succeeds outside a round resets it; at
MAX_UNATTRIBUTED_STEP_FAILURES the engine core gives up. Attributed failures do not
count, so no request, however often sent, takes the engine down; the price is that a
device that fails every step fails every request, one at a time, instead of dying.

The scheduler itself is guarded the same way (scheduler.py): an exception while it
schedules or updates one request ends that request alone with "error"; one it cannot
pin on a request fails the step, which is then isolated as above.

The isolator owns the suspects, the probe, the flush and the counter; it decides, and the
scheduler carries its decisions out (preempting, ending), since those touch the request
table and the KV cache.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvserve.core.block_pool import require_integrity

# Failed steps in a row that no request could be blamed for, after which the failure
# counts as the engine's: the core raises and dies.
MAX_UNATTRIBUTED_STEP_FAILURES = 3


class FailureIsolator:
    def __init__(self) -> None:
        # Insertion-ordered set of the requests still under suspicion.
        self._suspects: dict[str, None] = {}
        # The suspects the next steps may run (a subset of _suspects, chosen lazily).
        self._probe: set[str] = set()
        # A failed step's requests, for the empty step that drops them from the workers.
        self._flush_ids: set[str] = set()
        # Whether the current round already counts as unattributed (until a culprit).
        self._round_counted = False
        self.consecutive_unattributed_failures = 0

    def request_census(self) -> dict[str, int]:
        return {
            "suspects": len(self._suspects),
            "probe": len(self._probe),
            "flush": len(self._flush_ids),
        }

    @property
    def is_isolating(self) -> bool:
        return bool(self._suspects)

    @property
    def engine_is_broken(self) -> bool:
        return self.consecutive_unattributed_failures >= MAX_UNATTRIBUTED_STEP_FAILURES

    # ---- a failed step -------------------------------------------------------------------

    def step_failed(self, failed_ids: list[str]) -> str | None:
        """Judges a failed step whose running requests were ``failed_ids``: returns the
        culprit, a lone request, to end; else they become suspects, to preempt (with the
        idle_suspects still running)."""
        if len(failed_ids) == 1:
            if self._round_counted:  # the round found its culprit: it was no fault of ours
                self.consecutive_unattributed_failures -= 1
                self._round_counted = False
            return failed_ids[0]
        if not failed_ids:
            self.consecutive_unattributed_failures += 1
            return None
        if not self._suspects:
            self.consecutive_unattributed_failures += 1
            self._round_counted = True
        for request_id in failed_ids:
            self._suspects[request_id] = None
        self._probe = set(failed_ids[: (len(failed_ids) + 1) // 2])
        self._flush_ids |= set(failed_ids)
        return None

    def idle_suspects(self, running_ids: Iterable[str]) -> set[str]:
        """Suspects of an old probe that still run: only the new probe may, so they wait."""
        return {rid for rid in running_ids if rid in self._suspects}

    # ---- schedule() ----------------------------------------------------------------------

    def take_flush(self) -> set[str] | None:
        """The requests the empty step right after a failure drops from the workers, or
        None when no such step is due."""
        if not self._flush_ids:
            return None
        flush, self._flush_ids = self._flush_ids, set()
        return flush

    def probe(self) -> set[str] | None:
        """The requests a step may run while suspects remain (None: any)."""
        if not self._suspects:
            return None
        if not self._probe:
            suspects = list(self._suspects)
            self._probe = set(suspects[: (len(suspects) + 1) // 2])
        return self._probe

    def abandon(self) -> None:
        """Nothing of the probe could run (no blocks, a KV load pending): schedule as usual
        again; the round counts as unattributed."""
        self._suspects.clear()
        self._end_round()

    # ---- update_from_output() and finishing ----------------------------------------------

    def cleared(self, sampled_ids: list[str]) -> None:
        """Probe members that sampled in a step that succeeded are suspects no more."""
        for request_id in sampled_ids:
            self.forget(request_id)

    def step_succeeded(self) -> None:
        """A step with tokens succeeded outside a round: the engine works."""
        self.consecutive_unattributed_failures = 0

    def forget(self, request_id: str) -> None:
        if request_id in self._suspects:
            del self._suspects[request_id]
            self._probe.discard(request_id)
            if not self._suspects:
                self._end_round()

    def _end_round(self) -> None:
        self._probe.clear()
        self._flush_ids = set()
        self._round_counted = False

    def check_integrity(self, live_ids: Iterable[str], running_ids: Iterable[str]) -> None:
        require_integrity(self._probe <= self._suspects.keys(), "a probe member is no suspect")
        require_integrity(self._suspects.keys() <= set(live_ids), "a suspect is gone")
        for request_id in running_ids:
            require_integrity(
                request_id not in self._suspects or request_id in self._probe,
                f"{request_id} runs while a suspect outside the probe",
            )
        require_integrity(
            bool(self._suspects) or not self._round_counted, "a round counted without suspects"
        )
