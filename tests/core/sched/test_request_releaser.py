"""RequestReleaser alone: a finished, failed or preempted request gives back its blocks
once, through one object (a real KVCacheManager; no connector, text-only)."""

from __future__ import annotations

from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import RequestStatus
from kvserve.core.sched.encoder_planner import NoEncoderPlanner
from kvserve.core.sched.failure_isolator import FailureIsolator
from kvserve.core.sched.in_flight import InFlightBatches
from kvserve.core.sched.kv_transfer_planner import NoKVTransfer
from kvserve.core.sched.request_queue import SchedulingPolicy
from kvserve.core.sched.request_releaser import RequestReleaser
from kvserve.core.sched.request_table import RequestTable
from kvserve.protocol.engine_core import FinishReason
from tests.core.conftest import MakeRequest, kv_cache_config


def _releaser() -> RequestReleaser:
    manager = KVCacheManager(kv_cache_config(10), 64, enable_caching=True)
    return RequestReleaser(
        RequestTable(SchedulingPolicy.FCFS),
        manager,
        NoKVTransfer(),
        NoEncoderPlanner(),
        FailureIsolator(),
        InFlightBatches(1, max_num_running_reqs=8),
    )


def _running(releaser: RequestReleaser, make_request: MakeRequest, request_id: str):  # type: ignore[no-untyped-def]
    request = make_request(8, request_id)
    releaser.table.add(request)
    releaser.table.start_running(releaser.table.waiting.pop_request())
    assert releaser.kv_cache_manager.allocate_slots(request, 8) is not None
    return request


def test_fail_frees_the_blocks_and_reports_the_error(make_request: MakeRequest) -> None:
    releaser = _releaser()
    pool = releaser.kv_cache_manager.block_pool
    request = _running(releaser, make_request, "a")
    assert pool.get_num_free_blocks() == pool.num_blocks - 1 - 2
    releaser.fail(request, "ValueError: bad")
    assert pool.get_num_free_blocks() == pool.num_blocks - 1
    assert request.status == RequestStatus.FINISHED_ERROR and not releaser.table.requests
    [output] = releaser.table.take_pending_outputs()
    assert (output.request_id, output.finish_reason, output.error) == (
        "a",
        FinishReason.ERROR,
        "ValueError: bad",
    )
    assert releaser.table.take_finished_req_ids() == {"a"}
    releaser.free(request)  # a second release gives back nothing twice
    assert pool.get_num_free_blocks() == pool.num_blocks - 1


def test_preempt_drops_the_kv_and_requeues(make_request: MakeRequest) -> None:
    releaser = _releaser()
    pool = releaser.kv_cache_manager.block_pool
    request = _running(releaser, make_request, "a")
    releaser.preempt(releaser.table.pop_victim())
    assert pool.get_num_free_blocks() == pool.num_blocks - 1
    assert request.status == RequestStatus.PREEMPTED and list(releaser.table.waiting) == [request]
    assert request.num_preemptions == 1 and releaser.table.num_preemptions == 1


def test_free_without_a_connector_never_delays(make_request: MakeRequest) -> None:
    releaser = _releaser()
    request = _running(releaser, make_request, "a")
    assert releaser.free(request) is None
    assert not releaser.kv_transfer.has_delayed_frees()
    assert not releaser.kv_transfer.may_hold_blocks()
