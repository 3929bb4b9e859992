"""The census's own parts: the per-request class registry counted through the collector,
and the helpers that name leftovers. The whole census runs through a real server in
tests/entrypoints/openai/test_request_census.py."""

from __future__ import annotations

import gc

from kvserve.utils.census import leftovers, per_request, per_request_objects, prefixed


@per_request
class _Probe:
    def __init__(self) -> None:
        self.me = self  # a cycle: alive until the collector reaches it


KEY = f"objects.{__name__}._Probe"


def test_live_instances_are_counted_and_cycles_are_collected_first() -> None:
    kept = [_Probe(), _Probe()]
    _Probe()  # garbage, held only by its own cycle
    assert per_request_objects()[KEY] == 2
    del kept
    assert per_request_objects()[KEY] == 0
    assert gc.isenabled()


def test_leftovers_name_the_process_and_the_owner() -> None:
    census = {
        "api_server": prefixed("output_processor", {"request_states": 0, "parents": 2}),
        "engine_core": {"scheduler.table.requests": 1},
    }
    assert leftovers(census) == {
        "api_server:output_processor.parents": 2,
        "engine_core:scheduler.table.requests": 1,
    }
    assert leftovers({"worker_1": {"x": 0}}) == {}
