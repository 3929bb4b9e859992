"""MultiConnector: several connectors as one. The first that has a request's KV loads it;
every one of them saves.

Configured as ``kv_connector_extra_config={"connectors": [<KVTransferConfig fields>, ...]}``;
each child inherits kv_role, engine_id and kv_load_failure_policy unless it sets them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvserve.config import KVTransferConfig
from kvserve.distributed.kv_transfer.kv_connector.base import (
    ConnectorBlocks,
    ConnectorRequest,
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
)
from kvserve.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

if TYPE_CHECKING:
    import torch

    from kvserve.config import EngineConfig
    from kvserve.forward_context import ForwardContext
    from kvserve.protocol.kv_cache_interface import KVCacheConfig
    from kvserve.protocol.scheduler_output import SchedulerOutput


@dataclass
class MultiKVConnectorMetadata(KVConnectorMetadata):
    metadata: tuple[KVConnectorMetadata, ...] = ()
    # req_id -> how many more children than one still have to report it finished_sending.
    extra_async_saves: dict[str, int] = field(default_factory=dict)


class MultiConnector(KVConnectorBase_V1):
    def __init__(
        self,
        config: EngineConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(config, role, kv_cache_config)
        parent = self.kv_transfer_config
        children = parent.get_from_extra_config("connectors", None)
        if not isinstance(children, list) or not children:
            raise ValueError(
                "MultiConnector needs kv_connector_extra_config['connectors']: a non-empty "
                "list of connector configs"
            )
        self._connectors: list[KVConnectorBase_V1] = []
        for child in children:
            inherited = {
                "kv_role": parent.kv_role,
                "engine_id": parent.engine_id,
                "kv_load_failure_policy": parent.kv_load_failure_policy,
            }
            child_config = copy.copy(config)
            child_config.kv_transfer_config = KVTransferConfig.from_cli({**inherited, **child})
            self._connectors.append(
                KVConnectorFactory.create_connector(child_config, role, kv_cache_config)
            )
        # Scheduler side: which child loads each request; pending multi-child sends.
        self._loader: dict[str, int] = {}
        self._extra_async_saves: dict[str, int] = {}
        # Worker side: sends still owed by other children before a request counts as sent.
        self._sends_owed: dict[str, int] = {}

    @property
    def connectors(self) -> list[KVConnectorBase_V1]:
        return list(self._connectors)

    # ---- scheduler side --------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        result: tuple[int | None, bool] = (0, False)
        loader: int | None = None
        for i, connector in enumerate(self._connectors):
            num_tokens, load_async = connector.get_num_new_matched_tokens(
                request, num_computed_tokens
            )
            if num_tokens is None:
                return None, False  # one child is still looking: decide next step
            if loader is None and num_tokens > 0:
                loader, result = i, (num_tokens, load_async)
        self._loader.pop(request.request_id, None)
        if loader is not None:
            self._loader[request.request_id] = loader
        return result

    def update_state_after_alloc(
        self, request: ConnectorRequest, blocks: ConnectorBlocks, num_external_tokens: int
    ) -> None:
        loader = self._loader.get(request.request_id)
        for i, connector in enumerate(self._connectors):
            # Only the loader loads; the others learn the request started (they may save it).
            n = num_external_tokens if i == loader else 0
            connector.update_state_after_alloc(request, blocks, n)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = MultiKVConnectorMetadata(
            metadata=tuple(c.build_connector_meta(scheduler_output) for c in self._connectors),
            extra_async_saves=self._extra_async_saves,
        )
        self._extra_async_saves = {}
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for connector in self._connectors:
            connector.update_connector_output(connector_output)

    def request_finished(
        self, request: ConnectorRequest, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        num_delaying = 0
        params: dict[str, Any] | None = None
        for connector in self._connectors:
            delay, child_params = connector.request_finished(request, block_ids)
            num_delaying += int(delay)
            if child_params:
                params = {**child_params, **(params or {})}  # earlier children win on clashes
        if num_delaying > 1:
            self._extra_async_saves[request.request_id] = num_delaying - 1
        self._loader.pop(request.request_id, None)
        return num_delaying > 0, params

    # ---- worker side -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for connector in self._connectors:
            connector.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(connector_metadata, MultiKVConnectorMetadata)
        super().bind_connector_metadata(connector_metadata)
        for connector, meta in zip(self._connectors, connector_metadata.metadata, strict=True):
            connector.bind_connector_metadata(meta)
        for req_id, owed in connector_metadata.extra_async_saves.items():
            self._sends_owed[req_id] = self._sends_owed.get(req_id, 0) + owed

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        for connector in self._connectors:
            connector.clear_connector_metadata()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        for connector in self._connectors:
            connector.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        for connector in self._connectors:
            connector.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        for connector in self._connectors:
            connector.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        for connector in self._connectors:
            connector.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending: set[str] = set()
        recving: set[str] = set()
        for connector in self._connectors:
            child_sending, child_recving = connector.get_finished(finished_req_ids)
            recving |= child_recving or set()
            for req_id in child_sending or ():
                owed = self._sends_owed.get(req_id, 0)
                if owed > 0:  # another child still sends this request
                    self._sends_owed[req_id] = owed - 1
                else:
                    self._sends_owed.pop(req_id, None)
                    sending.add(req_id)
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors: set[int] = set()
        for connector in self._connectors:
            errors |= connector.get_block_ids_with_load_errors()
        return errors

    def shutdown(self) -> None:
        for connector in self._connectors:
            connector.shutdown()
