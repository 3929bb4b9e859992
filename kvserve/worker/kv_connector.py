"""vLLM's KVConnectorModelRunnerMixin as a component: the worker-side connector's
lifecycle around each forward, owned by one object the ModelRunner holds.

Per step: bind_connector_metadata -> start_load_kv -> (the forward; the attention layers
call wait_for_layer_load / save_kv_layer through the forward context) -> wait_for_save ->
get_finished (and get_block_ids_with_load_errors) -> clear_connector_metadata. A step that
runs no forward still goes through the same hooks, so asynchronous transfers progress and
get reported while every request waits on them.

Without a configured connector the runner holds the no-op ``KVConnector``, whose step
yields an empty report, so the hot path has no branch on whether transfers exist.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kvserve.config import EngineConfig
from kvserve.distributed.kv_transfer.kv_connector.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)
from kvserve.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from kvserve.forward_context import get_forward_context, set_forward_context
from kvserve.protocol.kv_cache_interface import KVCacheConfig
from kvserve.protocol.kv_connector_output import KVConnectorOutput
from kvserve.protocol.scheduler_output import SchedulerOutput


class KVConnector:
    """The no-op form: no transfers, an empty report every step."""

    # What the forward context hands the attention layers (None: no per-layer hooks).
    connector: KVConnectorBase_V1 | None = None

    @contextmanager
    def step(self, scheduler_output: SchedulerOutput) -> Iterator[KVConnectorOutput]:
        """Wraps one forward; enter it inside set_forward_context. The yielded report is
        filled when the block exits normally."""
        yield KVConnectorOutput()

    def no_forward(self, scheduler_output: SchedulerOutput) -> KVConnectorOutput:
        """The hooks of a step without model tokens (e.g. all requests wait on loads)."""
        return KVConnectorOutput()

    def get_handshake_metadata(self) -> dict[str, str] | None:
        return None

    def shutdown(self) -> None:
        pass


class ActiveKVConnector(KVConnector):
    """A configured connector's worker side, holding the registered KV caches."""

    def __init__(self, connector: KVConnectorBase_V1) -> None:
        self.connector: KVConnectorBase_V1 | None = connector
        self._connector = connector

    @contextmanager
    def step(self, scheduler_output: SchedulerOutput) -> Iterator[KVConnectorOutput]:
        output = KVConnectorOutput()
        connector = self._connector
        if scheduler_output.kv_connector_metadata is None:
            raise RuntimeError("a KV connector is configured but the step carries no metadata")
        connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
        try:
            connector.start_load_kv(get_forward_context())
            yield output
            connector.wait_for_save()
            sending, recving = connector.get_finished(scheduler_output.finished_req_ids)
            output.finished_sending, output.finished_recving = sending, recving
            output.invalid_block_ids = connector.get_block_ids_with_load_errors()
        finally:
            connector.clear_connector_metadata()

    def no_forward(self, scheduler_output: SchedulerOutput) -> KVConnectorOutput:
        with set_forward_context(None, kv_connector=self._connector):
            with self.step(scheduler_output) as output:
                pass
        return output

    def get_handshake_metadata(self) -> dict[str, str] | None:
        return self._connector.get_handshake_metadata()

    def shutdown(self) -> None:
        """The worker side's threads, sockets and queued writes end with the worker (the
        tiered cache's CacheEngine lives here, not in the scheduler)."""
        if self.connector is not None:
            self.connector = None
            self._connector.shutdown()


NO_OP_KV_CONNECTOR = KVConnector()


def get_kv_connector(
    config: EngineConfig, kv_cache_config: KVCacheConfig, kv_caches: dict[str, torch.Tensor]
) -> KVConnector:
    """The worker-side connector (handed the caches), or the no-op one when none is set."""
    transfer = config.kv_transfer_config
    if transfer is None or not transfer.is_kv_transfer_instance:
        return NO_OP_KV_CONNECTOR
    connector = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config)
    connector.register_kv_caches(kv_caches)
    return ActiveKVConnector(connector)
