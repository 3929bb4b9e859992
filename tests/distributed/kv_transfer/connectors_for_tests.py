"""A user connector, loaded by the engine through kv_connector_module_path.

AsyncLoadingConnector is a SharedStorageConnector whose loads run on a background thread:
its requests wait in WAITING_FOR_REMOTE_KVS until get_finished reports them. Per request,
kv_transfer_params steer it:
  {"fail_block_index": i}  the i-th loaded block is overwritten with noise and reported as a
                           load error (the scheduler must not use it);
  {"delay_free": true}     request_finished delays freeing; a background "send" reports the
                           request in finished_sending a moment later, and the final output
                           carries {"sent_by": <engine_id>} back.
It records, on the class, every status it saw its loading requests in, so tests can check
they passed through WAITING_FOR_REMOTE_KVS.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from kvserve.distributed.kv_transfer.kv_connector.base import (
    ConnectorBlocks,
    ConnectorRequest,
    KVConnectorMetadata,
)
from kvserve.distributed.kv_transfer.kv_connector.connectors.shared_storage import (
    LoadSpec,
    SharedStorageConnector,
    SharedStorageConnectorMetadata,
)
from kvserve.forward_context import ForwardContext
from kvserve.protocol.scheduler_output import SchedulerOutput

LOAD_DELAY_S = 0.2
SEND_DELAY_S = 0.1


@dataclass
class AsyncMetadata(SharedStorageConnectorMetadata):
    fail_block_index: dict[str, int] = field(default_factory=dict)
    sends: list[str] = field(default_factory=list)


class AsyncLoadingConnector(SharedStorageConnector):
    # req_id -> statuses (names) seen while its load was pending; shared with the tests.
    observed_statuses: ClassVar[dict[str, list[str]]] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._loading: dict[str, Any] = {}  # req_id -> Request, scheduler side
        self._fail_index: dict[str, int] = {}
        self._sends: list[str] = []
        self._lock = threading.Lock()
        self._done_recving: set[str] = set()
        self._done_sending: set[str] = set()

    # ---- scheduler side --------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        num_tokens, _ = super().get_num_new_matched_tokens(request, num_computed_tokens)
        return num_tokens, bool(num_tokens)

    def update_state_after_alloc(
        self, request: ConnectorRequest, blocks: ConnectorBlocks, num_external_tokens: int
    ) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if num_external_tokens > 0:
            self._loading[request.request_id] = request
            params = request.kv_transfer_params or {}
            if "fail_block_index" in params:
                self._fail_index[request.request_id] = int(params["fail_block_index"])

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        base = super().build_connector_meta(scheduler_output)
        assert isinstance(base, SharedStorageConnectorMetadata)
        for req_id, request in self._loading.items():
            self.observed_statuses.setdefault(req_id, []).append(request.status.name)
        meta = AsyncMetadata(base.loads, base.saves, self._fail_index, self._sends)
        self._fail_index, self._sends = {}, []
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        for req_id in connector_output.finished_recving or ():
            self._loading.pop(req_id, None)

    def request_finished(
        self, request: ConnectorRequest, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        super().request_finished(request, block_ids)
        self._loading.pop(request.request_id, None)
        if (request.kv_transfer_params or {}).get("delay_free"):
            self._sends.append(request.request_id)
            return True, {"sent_by": self.kv_transfer_config.engine_id}
        return False, None

    # ---- worker side -----------------------------------------------------------------------

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, AsyncMetadata)
        self._loads_to_do = []  # nothing loads inside the forward: all on threads
        for spec in meta.loads:
            fail_index = meta.fail_block_index.get(spec.req_id)
            threading.Thread(target=self._load_async, args=(spec, fail_index), daemon=True).start()
        for req_id in meta.sends:
            threading.Thread(target=self._send_async, args=(req_id,), daemon=True).start()

    def _load_async(self, spec: LoadSpec, fail_index: int | None) -> None:
        time.sleep(LOAD_DELAY_S)
        for layer_name in self._kv_caches:
            if not self._load_layer(spec, layer_name):
                break
        if fail_index is not None:
            bad_block = spec.block_ids[0][fail_index]
            for cache in self._kv_caches.values():
                cache[:, bad_block] = torch.randn_like(cache[:, bad_block]) * 10
            with self._lock:
                self._load_errors.add(bad_block)
        with self._lock:
            self._done_recving.add(spec.req_id)

    def _send_async(self, req_id: str) -> None:
        time.sleep(SEND_DELAY_S)
        with self._lock:
            self._done_sending.add(req_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        with self._lock:
            sending, self._done_sending = self._done_sending, set()
            recving, self._done_recving = self._done_recving, set()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            return super().get_block_ids_with_load_errors()


class NotAConnector:
    """For the factory test: a class in the module that is not a connector."""
