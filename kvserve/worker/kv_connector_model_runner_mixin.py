"""KVConnectorModelRunnerMixin: the worker-side connector's lifecycle around each forward.

Per step: bind the scheduler's metadata, start_load_kv, (the attention layers call
wait_for_layer_load / save_kv_layer through the forward context), wait_for_save,
get_finished and get_block_ids_with_load_errors, then clear the metadata. A step that
runs no forward still goes through the same hooks, so asynchronous transfers progress and
get reported while every request waits on them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kvserve.config import EngineConfig
from kvserve.distributed.kv_transfer.kv_connector.base import (
    KVConnectorBase_V1,
    KVConnectorOutput,
    KVConnectorRole,
)
from kvserve.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from kvserve.forward_context import get_forward_context, set_forward_context
from kvserve.protocol.kv_cache_interface import KVCacheConfig
from kvserve.protocol.scheduler_output import SchedulerOutput


class KVConnectorModelRunnerMixin:
    kv_connector: KVConnectorBase_V1 | None = None

    def init_kv_connector(
        self,
        config: EngineConfig,
        kv_cache_config: KVCacheConfig,
        kv_caches: dict[str, torch.Tensor],
    ) -> None:
        """Creates the worker-side connector (if configured) and hands it the caches."""
        transfer = config.kv_transfer_config
        if transfer is None or not transfer.is_kv_transfer_instance:
            self.kv_connector = None
            return
        self.kv_connector = KVConnectorFactory.create_connector(
            config, KVConnectorRole.WORKER, kv_cache_config
        )
        self.kv_connector.register_kv_caches(kv_caches)

    def shutdown_kv_connector(self) -> None:
        """The worker side's threads, sockets and queued writes end with the worker (the
        tiered cache's CacheEngine lives here, not in the scheduler)."""
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
            self.kv_connector = None

    @contextmanager
    def kv_connector_step(self, scheduler_output: SchedulerOutput) -> Iterator[KVConnectorOutput]:
        """Wraps one forward; enter it inside set_forward_context. The yielded output is
        filled when the block exits normally."""
        output = KVConnectorOutput()
        connector = self.kv_connector
        if connector is None:
            yield output
            return
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

    def kv_connector_no_forward(self, scheduler_output: SchedulerOutput) -> KVConnectorOutput:
        """The hooks of a step without model tokens (e.g. all requests wait on loads)."""
        with set_forward_context(None, kv_connector=self.kv_connector):
            with self.kv_connector_step(scheduler_output) as output:
                pass
        return output
