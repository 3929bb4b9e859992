"""Property test: random add / abort / step / preempt / reset-prefix-cache sequences.

A hypothesis state machine drives a real Scheduler (with its KVCacheManager and
BlockPool) through a small pool, so prefix hits, chunked prefills, preemption and
too-long requests all happen. Some requests are culprits: every step that runs one fails,
and the scheduler must find it by bisection (isolation.py) and fail it alone. After every rule the scheduler's check_integrity()
runs; at the end every request is driven to completion and every block must be free.
The driver plays the workers, sampling tokens (sometimes EOS) as a model runner would.
"""

from __future__ import annotations

import itertools
from typing import ClassVar

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvserve.core.kv_cache_utils import get_request_block_hasher
from kvserve.core.request import Request, RequestStatus
from kvserve.protocol.engine_core import FinishReason
from kvserve.sampling_params import SamplingParams
from tests.core.sched.conftest import build_scheduler
from tests.core.sched.driver import BS, EOS, Driver

NUM_BLOCKS = 16  # 15 usable: 60 tokens, less than four long requests need at once
MAX_MODEL_LEN = 64
# Shared prompt starts, so later requests hit blocks earlier ones cached.
PREFIXES = [list(range(1000 + 50 * i, 1000 + 50 * i + 24)) for i in range(3)]


class SchedulerMachine(RuleBasedStateMachine):
    # Summed over all runs, so the test can show the interesting paths were taken.
    totals: ClassVar[dict[str, int]] = {
        "steps": 0,
        "preemptions": 0,
        "prefix_hits": 0,
        "errors": 0,
        "failed_steps": 0,
        "culprits_failed": 0,
    }

    # Mamba groups beside the attention group (the Mamba machines below).
    num_mamba_groups: ClassVar[int] = 0
    enable_prefix_caching: ClassVar[bool] = True

    def __init__(self) -> None:
        super().__init__()
        self.scheduler = build_scheduler(
            num_blocks=NUM_BLOCKS + 8 * self.num_mamba_groups,
            enable_prefix_caching=self.enable_prefix_caching,
            max_num_batched_tokens=16,
            max_num_seqs=4,
            max_model_len=MAX_MODEL_LEN,
            num_mamba_groups=self.num_mamba_groups,
        )
        self.driver = Driver(self.scheduler)
        self.ids = itertools.count()
        self.max_tokens: dict[str, int] = {}
        self.live: set[str] = set()  # what the scheduler must still hold
        self.culprits: set[str] = set()  # every step that runs one of these fails
        self.too_long: set[str] = set()

    @rule(
        prefix=st.integers(0, len(PREFIXES) - 1),
        shared=st.integers(0, 24),
        extra=st.integers(1, 12),
        max_tokens=st.integers(1, 8),
        too_long=st.booleans(),
        culprit=st.integers(0, 4),
    )
    def add(
        self, prefix: int, shared: int, extra: int, max_tokens: int, too_long: bool, culprit: int
    ) -> None:
        n = next(self.ids)
        request_id = f"r{n}"
        if too_long and n % 5 == 0:
            extra = MAX_MODEL_LEN  # the scheduler must end it with an error, not hang
            self.too_long.add(request_id)
        elif culprit == 0:
            self.culprits.add(request_id)
        prompt = PREFIXES[prefix][:shared] + [3000 + 100 * n + i for i in range(extra)]
        self.driver.add(
            Request(
                request_id=request_id,
                prompt_token_ids=prompt,
                sampling_params=SamplingParams(max_tokens=max_tokens),
                eos_token_id=EOS,
                arrival_time=float(n),
                block_hasher=get_request_block_hasher(BS, 0),
            )
        )
        self.max_tokens[request_id] = max_tokens
        self.live.add(request_id)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.live)))
        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
        self.live.discard(request_id)

    @rule(eos_for=st.sets(st.integers(0, 3), max_size=2))
    def step(self, eos_for: set[int]) -> None:
        running = [r.request_id for r in self.scheduler.running]
        tokens = {rid: EOS for i, rid in enumerate(running) if i in eos_for}
        self._step(tokens)

    @precondition(lambda self: bool(self.scheduler.running))
    @rule()
    def preempt(self) -> None:
        # The scheduler's own recompute path, as schedule() takes it when blocks run out.
        self.scheduler.releaser.preempt(self.scheduler.table.pop_victim())

    @rule()
    def reset_prefix_cache(self) -> None:
        pool = self.scheduler.kv_cache_manager.block_pool
        idle = pool.get_num_free_blocks() == pool.num_blocks - 1
        assert self.scheduler.reset_prefix_cache() == idle
        if idle:
            assert not pool.cached_block_hash_to_block

    @invariant()
    def consistent(self) -> None:
        self.scheduler.check_integrity()
        assert set(self.scheduler.requests) == self.live

    def teardown(self) -> None:
        for _ in range(400):  # bounded: every request has at most 8 tokens to make
            if not self.scheduler.has_requests():
                break
            self._step({})
        assert not self.live and not self.scheduler.requests
        assert not self.scheduler.is_isolating
        self.scheduler.check_integrity()
        pool = self.scheduler.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_blocks - 1, "KV blocks leaked"
        stats = self.scheduler.make_stats()  # what kvserve:kv_cache_blocks_in_use shows
        assert stats is not None and stats.kv_cache_blocks_in_use == 0

    def _step(self, tokens: dict[str, int]) -> None:
        out, outputs = self.driver.step(tokens, fail_if=self.culprits)
        totals = type(self).totals
        totals["steps"] += 1
        stats = outputs.scheduler_stats
        if stats is None:  # a failed step
            totals["failed_steps"] += 1
        else:
            totals["prefix_hits"] += stats.prefix_cache_hits
            totals["preemptions"] += len(out.preempted_req_ids)  # for want of blocks
        for output in outputs.outputs:
            request_id = output.request_id
            assert request_id in self.live, f"output for {request_id}, which is not live"
            assert len(self.driver.tokens(request_id)) <= self.max_tokens[request_id]
            if output.finish_reason is not None:
                self.live.discard(request_id)
                if output.finish_reason == FinishReason.ERROR:
                    # Only a culprit, alone in its step, or a request too long ever fails.
                    assert request_id in self.culprits | self.too_long, f"{request_id} failed"
                    totals["errors"] += 1
                    totals["culprits_failed"] += request_id in self.culprits
                elif self.driver.tokens(request_id)[-1] != EOS:
                    assert len(self.driver.tokens(request_id)) == self.max_tokens[request_id]


def test_scheduler_state_machine_keeps_its_invariants() -> None:
    SchedulerMachine.totals = dict.fromkeys(SchedulerMachine.totals, 0)
    run_state_machine_as_test(
        SchedulerMachine,
        settings=settings(
            max_examples=30,
            stateful_step_count=40,
            derandomize=True,  # the same sequences on every CI run
            database=None,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
    totals = SchedulerMachine.totals
    assert totals["steps"] >= 300
    assert totals["preemptions"] > 0 and totals["prefix_hits"] > 0 and totals["errors"] > 0
    assert totals["failed_steps"] > totals["culprits_failed"] > 0


class HybridMambaMachine(SchedulerMachine):
    """The same machine over a hybrid layout without prefix caching: an attention group
    and two Mamba groups, where every running request holds exactly one state block
    per Mamba group."""

    num_mamba_groups = 2
    enable_prefix_caching = False
    totals: ClassVar[dict[str, int]] = dict.fromkeys(SchedulerMachine.totals, 0)

    @invariant()
    def one_state_block_per_mamba_group(self) -> None:
        managers = self.scheduler.kv_cache_manager.coordinator.single_type_managers
        for request in self.scheduler.table.running:
            for manager in managers[1:]:
                assert len(manager.req_to_blocks.get(request.request_id, ())) == 1


class AlignedMambaMachine(SchedulerMachine):
    """The hybrid layout with prefix caching (align mode): block-end states are cache
    entries and hits; a running request's live state is its table's last entry and it
    holds at most 5 blocks per Mamba group (MambaManager.check_integrity)."""

    num_mamba_groups = 2
    totals: ClassVar[dict[str, int]] = dict.fromkeys(SchedulerMachine.totals, 0)


_MAMBA_SETTINGS = settings(
    max_examples=8,
    stateful_step_count=40,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_scheduler_state_machine_with_mamba_groups() -> None:
    HybridMambaMachine.totals = dict.fromkeys(SchedulerMachine.totals, 0)
    run_state_machine_as_test(HybridMambaMachine, settings=_MAMBA_SETTINGS)
    totals = HybridMambaMachine.totals
    assert totals["steps"] >= 100
    assert totals["preemptions"] > 0 and totals["errors"] > 0
    assert totals["prefix_hits"] == 0


def test_scheduler_state_machine_with_cached_mamba_states() -> None:
    AlignedMambaMachine.totals = dict.fromkeys(SchedulerMachine.totals, 0)
    run_state_machine_as_test(AlignedMambaMachine, settings=_MAMBA_SETTINGS)
    totals = AlignedMambaMachine.totals
    assert totals["steps"] >= 100
    assert totals["preemptions"] > 0 and totals["prefix_hits"] > 0 and totals["errors"] > 0
