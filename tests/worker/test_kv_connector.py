"""The KV connector component's per-step lifecycle, with a recording fake connector (no
model, no caches): the order of vLLM's hooks, the report it fills, the no-op form."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from kvserve.forward_context import get_forward_context, set_forward_context
from kvserve.protocol.scheduler_output import KVConnectorMetadata, SchedulerOutput
from kvserve.worker.kv_connector import NO_OP_KV_CONNECTOR, ActiveKVConnector


@dataclass
class FakeMetadata(KVConnectorMetadata):
    step: int = 0


class RecordingConnector:
    """Records the hooks the component calls, in order."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.metadata: KVConnectorMetadata | None = None
        self.forward_context: Any = None

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        self.calls.append("bind_connector_metadata")
        self.metadata = metadata

    def start_load_kv(self, forward_context: Any) -> None:
        self.calls.append("start_load_kv")
        self.forward_context = forward_context

    def wait_for_save(self) -> None:
        self.calls.append("wait_for_save")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        self.calls.append("get_finished")
        return {f"sent-{r}" for r in finished_req_ids}, {"loaded"}

    def get_block_ids_with_load_errors(self) -> set[int]:
        self.calls.append("get_block_ids_with_load_errors")
        return {7}

    def clear_connector_metadata(self) -> None:
        self.calls.append("clear_connector_metadata")
        self.metadata = None

    def get_handshake_metadata(self) -> dict[str, str]:
        return {"host": "here"}

    def shutdown(self) -> None:
        self.calls.append("shutdown")


def _step_output(finished: frozenset[str] = frozenset()) -> SchedulerOutput:
    out = SchedulerOutput.empty()
    out.finished_req_ids = set(finished)
    out.kv_connector_metadata = FakeMetadata(step=1)
    return out


def test_step_runs_vllm_lifecycle_around_the_forward_and_fills_the_report() -> None:
    fake = RecordingConnector()
    component = ActiveKVConnector(fake)  # type: ignore[arg-type]
    assert component.connector is fake
    with set_forward_context("attn", kv_connector=fake):
        with component.step(_step_output(frozenset({"r"}))) as report:
            assert fake.calls == ["bind_connector_metadata", "start_load_kv"]
            assert fake.forward_context is get_forward_context()
            assert report.is_empty()  # filled only after the forward
            fake.calls.append("forward")
    assert fake.calls == [
        "bind_connector_metadata",
        "start_load_kv",
        "forward",
        "wait_for_save",
        "get_finished",
        "get_block_ids_with_load_errors",
        "clear_connector_metadata",
    ]
    assert report.finished_sending == {"sent-r"} and report.finished_recving == {"loaded"}
    assert report.invalid_block_ids == {7}


def test_a_failed_forward_still_clears_the_metadata() -> None:
    fake = RecordingConnector()
    component = ActiveKVConnector(fake)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="boom"), set_forward_context(None):
        with component.step(_step_output()):
            raise RuntimeError("boom")
    assert fake.calls[-1] == "clear_connector_metadata" and fake.metadata is None
    assert "wait_for_save" not in fake.calls


def test_step_without_metadata_is_an_error() -> None:
    component = ActiveKVConnector(RecordingConnector())  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="no metadata"), set_forward_context(None):
        with component.step(SchedulerOutput.empty()):
            pass


def test_no_forward_step_goes_through_the_same_hooks() -> None:
    fake = RecordingConnector()
    report = ActiveKVConnector(fake).no_forward(_step_output(frozenset({"a"})))  # type: ignore[arg-type]
    assert fake.calls[0] == "bind_connector_metadata"
    assert fake.calls[-1] == "clear_connector_metadata"
    assert report.finished_sending == {"sent-a"}


def test_shutdown_once_and_handshake() -> None:
    fake = RecordingConnector()
    component = ActiveKVConnector(fake)  # type: ignore[arg-type]
    assert component.get_handshake_metadata() == {"host": "here"}
    component.shutdown()
    component.shutdown()
    assert fake.calls == ["shutdown"] and component.connector is None


def test_no_op_connector_yields_an_empty_report() -> None:
    out = SchedulerOutput.empty()  # no metadata: nothing is asked of a missing connector
    assert NO_OP_KV_CONNECTOR.connector is None
    with NO_OP_KV_CONNECTOR.step(out) as report:
        pass
    assert report.is_empty()
    assert NO_OP_KV_CONNECTOR.no_forward(out).is_empty()
    assert NO_OP_KV_CONNECTOR.get_handshake_metadata() is None
    NO_OP_KV_CONNECTOR.shutdown()
