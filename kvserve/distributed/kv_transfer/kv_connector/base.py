"""KVConnectorBase_V1: the plug-in surface between the engine and external KV stores.

One class, two instances: the scheduler builds one with role SCHEDULER (engine core
process, no tensors), the model runner one with role WORKER (owns the KV cache). The
scheduler side answers "how many tokens of this request can you provide?" and plans
loads and saves; each step it packs that plan into a KVConnectorMetadata, which rides on
SchedulerOutput to the worker side. The worker side does the transfers around and inside
the forward pass, and reports back through KVConnectorOutput (on ModelRunnerOutput).

Step order, as the engine calls the hooks:

    scheduler: get_num_new_matched_tokens -> update_state_after_alloc   (per admitted request)
               build_connector_meta                                    (once, end of schedule)
    worker:    bind_connector_metadata -> start_load_kv
               per attention layer: wait_for_layer_load -> attention -> save_kv_layer
               wait_for_save -> get_finished / get_block_ids_with_load_errors
               -> clear_connector_metadata
    scheduler: update_connector_output; request_finished when a request ends

This module stays free of torch at import time: the scheduler (core/) imports it.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Protocol

# The messages connectors speak, defined in protocol/ beside SchedulerOutput and
# ModelRunnerOutput, which carry them across processes; connectors import them here.
from kvserve.protocol.kv_connector_output import KVConnectorOutput as KVConnectorOutput
from kvserve.protocol.scheduler_output import KVConnectorMetadata as KVConnectorMetadata

if TYPE_CHECKING:
    import torch

    from kvserve.config import EngineConfig, KVTransferConfig
    from kvserve.forward_context import ForwardContext
    from kvserve.protocol.kv_cache_interface import KVCacheConfig
    from kvserve.protocol.scheduler_output import SchedulerOutput


# How the error of a request ended by kv_load_failure_policy "fail" begins: the OpenAI
# server shows such errors to the client (503) instead of hiding them as internal ones.
KV_LOAD_FAILURE_PREFIX = "KV connector failed to load external KV"


class KVConnectorRole(enum.IntEnum):
    SCHEDULER = 0
    WORKER = 1


class ConnectorRequest(Protocol):
    """What a connector may read of a scheduler Request (core.request.Request fits)."""

    request_id: str
    prompt_token_ids: list[int]
    num_computed_tokens: int
    cache_salt: str | None
    kv_transfer_params: dict[str, Any] | None

    @property
    def all_token_ids(self) -> list[int]: ...

    @property
    def num_tokens(self) -> int: ...


class ConnectorBlocks(Protocol):
    """A request's KV blocks (core.kv_cache_manager.KVCacheBlocks fits)."""

    def get_block_ids(self) -> tuple[list[int], ...]: ...


class KVConnectorBase_V1(ABC):
    def get_handshake_metadata(self) -> dict[str, str] | None:
        """Worker side: what the scheduler-side connector needs to reach this rank (an
        address bound at start-up), or None. The engine core gathers it from every rank
        once the workers are up (vLLM's handshake metadata)."""
        return None

    def set_xfer_handshake_metadata(self, metadata: dict[int, dict[str, str]]) -> None:
        """Scheduler side: every rank's get_handshake_metadata, by rank (those that gave
        any)."""
        return None

    @classmethod
    def check_parallel_config(cls, config: EngineConfig) -> None:
        """Raises ValueError when this connector cannot run with config's parallelism.
        The default refuses more than one rank (each rank holds only its own KV heads
        of its own layers); a connector that serves several ranks overrides it."""
        parallel = config.parallel_config
        if parallel.world_size > 1:
            raise ValueError(
                f"kv_transfer_config.kv_connector {cls.__name__!r} does not support "
                f"tensor_parallel_size {parallel.tensor_parallel_size} x "
                f"pipeline_parallel_size {parallel.pipeline_parallel_size} yet "
                "(TieredCacheConnector and SharedStorageConnector support tensor and "
                "pipeline parallelism, P2pZmqConnector tensor parallelism)"
            )

    def __init__(
        self,
        config: EngineConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        if config.kv_transfer_config is None:
            raise ValueError("a KV connector needs config.kv_transfer_config")
        self._config = config
        self._role = role
        self._connector_metadata: KVConnectorMetadata | None = None

    @property
    def role(self) -> KVConnectorRole:
        return self._role

    @property
    def kv_transfer_config(self) -> KVTransferConfig:
        assert self._config.kv_transfer_config is not None
        return self._config.kv_transfer_config

    # ---- worker side: metadata binding (called by the runner's connector component) ---

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Worker side, before start_load_kv each step: the plan the scheduler built."""
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        """Worker side, after the step's get_finished: the plan is spent."""
        self._connector_metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        if self._connector_metadata is None:
            raise RuntimeError("no connector metadata is bound: this hook runs inside a step")
        return self._connector_metadata

    # ---- worker side: transfers ------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Worker side, once, after the KV cache is allocated: layer name -> cache tensor.

        The tensors are the live cache ([2, num_blocks, block_size, kv_heads, head_size] on
        the CPU backend); loads write into them in place.
        """
        return None

    @abstractmethod
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Worker side, each step, inside the forward context and before the forward.

        Starts (or does) the loads the bound metadata asks for. A synchronous connector
        may load everything here; a layer-wise one only starts and finishes each layer in
        wait_for_layer_load; an asynchronous one starts background work whose requests it
        reports later through get_finished(). Must not raise for a failed load: record the
        blocks for get_block_ids_with_load_errors instead.
        """

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Worker side, in each attention layer before it reads the cache: returns when
        the layer's synchronous loads are in place (no-op when nothing is pending)."""

    @abstractmethod
    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Worker side, in each attention layer after it wrote this step's KV: may start
        saving the blocks the metadata names from kv_layer (the layer's whole cache)."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Worker side, after the forward: returns when this step's synchronous saves are
        durable (so the blocks may be reused); asynchronous saves go on and are reported
        through get_finished()."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Worker side, once per step after wait_for_save: (finished_sending,
        finished_recving) request ids whose asynchronous save / load completed since the
        last call. finished_req_ids are requests the scheduler finished in this step.
        Synchronous connectors return (None, None)."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Worker side, once per step after get_finished: block ids whose load failed since
        the last call (each reported once). The scheduler then follows
        kv_load_failure_policy: recompute from the first bad block, or fail the request."""
        return set()

    # ---- scheduler side --------------------------------------------------------------------

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Scheduler side, when a WAITING request is considered for admission.

        num_computed_tokens are the tokens the local prefix cache already holds. Returns
        (external tokens beyond those, load_async). The count must leave at least the
        last token to compute and keep the total a multiple of the block size unless it
        reaches a full prompt prefix; None means "ask again next step" (lookup pending).
        load_async=True parks the request in WAITING_FOR_REMOTE_KVS until the worker side
        reports it in finished_recving. May be called again for the same request when its
        admission failed (no free blocks), so keep it side-effect free or idempotent.
        """

    def computes_exact_kv(self, request: ConnectorRequest) -> bool:
        """Scheduler side: False when this connector fills the request's KV approximately
        (CacheBlend reuses documents' KV computed elsewhere): such blocks must never become
        prefix-cache entries that an exact request could hit."""
        return True

    @abstractmethod
    def update_state_after_alloc(
        self, request: ConnectorRequest, blocks: ConnectorBlocks, num_external_tokens: int
    ) -> None:
        """Scheduler side, right after a request admitted from WAITING got its blocks
        (all of them: local hits, external slots, new ones). num_external_tokens is what
        get_num_new_matched_tokens returned (0: nothing to load, but the request is
        starting and may be saved later)."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Scheduler side, once at the end of each schedule(): the plan for this step's
        loads and saves. Called before the scheduler advances num_computed_tokens, so the
        scheduled ranges are [num_computed_tokens, + num_scheduled_tokens). Resets the
        per-step state it consumed."""

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Scheduler side, in update_from_output after the scheduler applied the worker's
        report (finished transfers, invalid blocks)."""
        return None

    def request_finished(
        self, request: ConnectorRequest, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler side, when a request finishes (stop, length, abort, error), before its
        blocks are freed. Returns (delay_free, kv_transfer_params): delay_free=True keeps
        the blocks until the worker side reports the request in finished_sending (an
        asynchronous save, or a load still writing into them); kv_transfer_params go back
        to the caller on the request's final output."""
        return False, None

    def get_kv_connector_stats(self) -> dict[str, dict[str, float]] | None:
        """Scheduler side, whenever the scheduler makes its stats: running totals since
        start as {metric: {label: value}} (for example {"hits": {"local_cpu": 7}}). The
        engine exports each one as the Prometheus counter ``kvserve:kv_connector_<metric>``
        with the label as ``kind``. None = nothing to report."""
        return None

    def shutdown(self) -> None:
        """Either side, when the engine stops: release threads, sockets, files."""
        return None
