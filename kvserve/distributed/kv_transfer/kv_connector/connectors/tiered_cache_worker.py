"""TieredCacheConnector's worker side: one rank's KV shard between the paged cache and the
tier.

The tier's KV shape is [num_layers, 2, num_tokens, kv_heads, head_size]; this
connector gathers it from, and scatters it into, the paged caches ([2, num_blocks,
block_size, kv_heads, head_size] per layer) through token slots, each layer through the
block table of its KV cache group. Sliding-window groups are served when the window is
wider than a chunk: a chunk is saved in the step that completes it, before any of its
blocks leaves the window; chunks whose blocks a window already dropped (a local prefix
hit holds null blocks there) are not saved. Loads run in start_load_kv,
or in a background thread with enable_async_loading (the request waits in
WAITING_FOR_REMOTE_KVS until get_finished reports it). Saves run in wait_for_save. Tokens
a load could not bring back are reported as load errors: the scheduler recomputes them.
Under TP and PP all ranks agree (a gloo all-gather over the world, in steps that load)
on how far every rank loaded and on which async loads every rank finished, so each
reports the same thing and no rank computes on a head or layer another rank failed to
bring back: the scheduler hears from the last stage's first TP rank only.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvserve.distributed.kv_events_publisher import ZmqEventPublisher, offset_port
from kvserve.distributed.kv_transfer.kv_connector.base import KVConnectorMetadata
from kvserve.distributed.tier_events import PublishingTierEventSink
from kvserve.kvcache.builder import CacheEngineBuilder
from kvserve.kvcache.control import ControlServer
from kvserve.kvcache.key import CacheEngineMetadata
from kvserve.kvcache.lookup import LookupServer, lookup_address
from kvserve.protocol.kv_blend import BlendSpec

if TYPE_CHECKING:
    import torch

    from kvserve.config import EngineConfig
    from kvserve.distributed.parallel_state import GroupCoordinator
    from kvserve.forward_context import ForwardContext
    from kvserve.kvcache.cache_engine import CacheEngine
    from kvserve.kvcache.config import CacheEngineConfig
    from kvserve.kvcache.integrity import KVAuthenticator
    from kvserve.utils.zmq_curve import SocketSecurity

logger = logging.getLogger(__name__)


@dataclass
class TransferSpec:
    req_id: str
    token_ids: list[int]  # the prefix the chunk keys are computed over
    start: int  # tokens [start, end) move between the tier and the blocks
    end: int
    block_ids: list[list[int]]  # per group, the request's blocks covering tokens [0, end)
    tags: tuple[tuple[str, str], ...] = ()


@dataclass
class TieredCacheConnectorMetadata(KVConnectorMetadata):
    loads: list[TransferSpec] = field(default_factory=list)
    saves: list[TransferSpec] = field(default_factory=list)
    # Request ids whose lookup pins every rank drops (no load planned, or finished).
    releases: list[str] = field(default_factory=list)
    # CacheBlend: requests whose whole prompt runs in this step with segment reuse (the
    # model runner's blend component does the work: it needs the model's rotary).
    blends: list[BlendSpec] = field(default_factory=list)


class TieredCacheWorker:
    """The worker-side hooks of TieredCacheConnector (mixed into it)."""

    block_size: int
    world_size: int
    async_loading: bool
    _instance_id: str
    _layer_group: dict[str, int]
    _security: SocketSecurity  # for the lookup service when it listens on TCP
    # Set by _init_worker; None on the scheduler side.
    _engine: CacheEngine | None = None
    _lookup_server: LookupServer | None = None
    _loader: ThreadPoolExecutor | None = None
    _world: GroupCoordinator | None = None  # the whole world; None with one rank
    # A cache controller's view (tier_events_endpoint / control_endpoint); None when off.
    _tier_events: PublishingTierEventSink | None = None
    _control_server: ControlServer | None = None

    if TYPE_CHECKING:

        def _get_connector_metadata(self) -> KVConnectorMetadata: ...

    def _init_worker(
        self, config: EngineConfig, cache_config: CacheEngineConfig, auth: KVAuthenticator
    ) -> None:
        """This rank's CacheEngine (keys carry worker_id = its global rank: TP ranks hold
        other heads, PP stages other layers) and the lookup service the scheduler asks."""
        from kvserve.distributed.parallel_state import get_world_group

        rank = 0
        if self.world_size > 1:
            self._world = get_world_group()
            rank = self._world.rank_in_group
        metadata = CacheEngineMetadata(
            model_name=config.model_config.resolved.name,
            world_size=self.world_size,
            worker_id=rank,
            kv_dtype=config.cache_config.kv_dtype(config.model_config.dtype),
        )
        self._engine = CacheEngineBuilder.get_or_create(
            self._instance_id, cache_config, metadata, auth
        )
        self._lookup_address = lookup_address(self._instance_id, rank)
        # Ray may place ranks on other machines than the engine core: TCP on this node's
        # address, announced through the handshake. Otherwise an ipc path both sides know.
        tcp_host = None
        if config.parallel_config.distributed_executor_backend == "ray":
            import ray

            tcp_host = ray.util.get_node_ip_address()
        self._lookup_server = LookupServer.acquire(
            self._engine, self._lookup_address, tcp_host, self._security
        )
        self._start_controller_services(cache_config, rank)
        # (cache, KV cache group) per layer in model order.
        self._kv_caches: list[tuple[torch.Tensor, int]] = []
        self._async_loads: dict[str, tuple[TransferSpec, Future[int]]] = {}
        self._load_errors: set[int] = set()

    @property
    def engine(self) -> CacheEngine:
        """The worker side's CacheEngine (this rank's shard)."""
        if self._engine is None:
            raise RuntimeError("only the worker side of TieredCacheConnector owns a CacheEngine")
        return self._engine

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # Layer order is the model's (dict order), the same in every process.
        self._kv_caches = [
            (cache, self._layer_group.get(name, 0)) for name, cache in kv_caches.items()
        ]

    def _block_runs(
        self, block_ids: list[int], lo: int, hi: int
    ) -> Iterator[tuple[int, int, int, int]]:
        """(block id, first slot, end slot, offset from lo) of each block holding tokens
        [lo, hi). Copying block by block is plain memcpy; index_put over token slots is
        some 50x slower on CPU."""
        bs = self.block_size
        for b in range(lo // bs, -(-hi // bs)):
            first, end = max(lo, b * bs), min(hi, (b + 1) * bs)
            yield block_ids[b], first - b * bs, end - b * bs, first - lo

    def _load(self, spec: TransferSpec) -> int:
        """Writes tokens [start, end) from the tier into the blocks; returns how far it got
        (spec.end on success). Never raises."""
        loaded = spec.start
        try:
            result = self.engine.retrieve(
                spec.token_ids, spec.end, lookup_id=spec.req_id, tags=spec.tags, start=spec.start
            )
            for chunk_start, chunk_end, kv in result.chunks:
                lo, hi = max(chunk_start, spec.start), min(chunk_end, spec.end)
                if hi <= lo:
                    continue
                part = kv.narrow(2, lo - chunk_start, hi - lo)
                runs = [list(self._block_runs(ids, lo, hi)) for ids in spec.block_ids]
                for layer, (cache, group) in enumerate(self._kv_caches):
                    src = part[layer]
                    for block, s0, s1, off in runs[group]:
                        cache[:, block, s0:s1].copy_(src[:, off : off + s1 - s0])
                loaded = hi
        except Exception:  # a failed load is recomputed, never a crashed step
            logger.exception("KV tier load for %s failed", spec.req_id)
            self.engine.release(spec.req_id)
        return loaded

    def _bad_blocks(self, spec: TransferSpec, loaded: int) -> set[int]:
        """The blocks of spec a load that stopped at token `loaded` left unfilled."""
        if loaded >= spec.end:
            return set()
        logger.warning(
            "KV tier load for %s stopped at token %d of %d", spec.req_id, loaded, spec.end
        )
        first_bad = loaded // self.block_size
        return {block for ids in spec.block_ids for block in ids[first_bad:]}

    def _agree(self, values: list[int]) -> list[int]:
        """The minimum of each value over all ranks (TP and PP). Every rank calls it at the
        same point with as many values (they follow the same metadata, and every stage
        runs the batches in the same order, batch queue or not), so the collective always
        matches up; one rank alone keeps its values."""
        if self._world is None or not values:
            return values
        import torch

        gathered = self._world.all_gather(torch.tensor(values, dtype=torch.int64), dim=0)
        return [int(v) for v in gathered.view(self.world_size, -1).min(dim=0).values]

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TieredCacheConnectorMetadata)
        for req_id in meta.releases:
            self.engine.release(req_id)
        if self.async_loading:
            for spec in meta.loads:
                if self._loader is None:
                    self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvcache-load")
                self._async_loads[spec.req_id] = (spec, self._loader.submit(self._load, spec))
            return
        loaded = self._agree([self._load(spec) for spec in meta.loads])
        for spec, upto in zip(meta.loads, loaded, strict=True):
            self._load_errors |= self._bad_blocks(spec, upto)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads complete in start_load_kv (or asynchronously, before scheduling)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # saved whole in wait_for_save, once every layer holds this step's KV

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TieredCacheConnectorMetadata)
        import torch

        for spec in meta.saves:
            try:
                first = self._kv_caches[0][0]
                kv = torch.empty(
                    (len(self._kv_caches), 2, spec.end - spec.start, *first.shape[3:]),
                    dtype=first.dtype,
                )
                runs = [list(self._block_runs(ids, spec.start, spec.end)) for ids in spec.block_ids]
                for layer, (cache, group) in enumerate(self._kv_caches):
                    for block, s0, s1, off in runs[group]:
                        kv[layer, :, off : off + s1 - s0].copy_(cache[:, block, s0:s1])
                self.engine.store(spec.token_ids, kv, spec.start, spec.tags)
            except Exception:  # a failed save loses a cache entry, never a request
                logger.exception("KV tier save for %s failed", spec.req_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # Every rank holds the same pending loads (same metadata); a load is finished once
        # it is on every rank, and good as far as every rank got.
        pending = sorted(self._async_loads)
        done_everywhere = self._agree([int(self._async_loads[r][1].done()) for r in pending])
        done = [r for r, ok in zip(pending, done_everywhere, strict=True) if ok]
        loaded = self._agree([self._async_loads[r][1].result() for r in done])
        for req_id, upto in zip(done, loaded, strict=True):
            spec, _ = self._async_loads.pop(req_id)
            self._load_errors |= self._bad_blocks(spec, upto)
        return None, (set(done) or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_handshake_metadata(self) -> dict[str, str] | None:
        server = self._lookup_server
        if server is None or server.address == self._lookup_address:
            return None  # the ipc path, which the scheduler side derives itself
        return {"lookup_address": server.address}

    def _start_controller_services(self, cache_config: CacheEngineConfig, rank: int) -> None:
        """The tier events and the control service a cache controller follows and calls;
        each rank on the configured port plus its rank."""
        assert self._engine is not None
        if cache_config.tier_events_endpoint is not None:
            publisher = ZmqEventPublisher(
                offset_port(cache_config.tier_events_endpoint, rank), security=self._security
            )
            self._tier_events = PublishingTierEventSink(publisher, cache_config.chunk_size)
            self._engine.storage.attach_events(self._tier_events)
        if cache_config.control_endpoint is not None:
            self._control_server = ControlServer(
                self._engine, offset_port(cache_config.control_endpoint, rank), self._security
            )

    def _shutdown_worker(self) -> None:
        if self._control_server is not None:
            self._control_server.close()
            self._control_server = None
        if self._loader is not None:
            self._loader.shutdown(wait=True)
            self._loader = None
        if self._lookup_server is not None:
            LookupServer.release(self._lookup_address)
            self._lookup_server = None
        if self._engine is not None:
            # Queued disk writes land before the process may exit.
            self._engine.flush(timeout=60)
            CacheEngineBuilder.release(self._instance_id)
            self._engine = None
        if self._tier_events is not None:
            self._tier_events.close()
            self._tier_events = None
