"""TieredCacheConnector: the engine's paged KV cache in front of the kvcache tier.

Roles: the worker side on each rank owns a CacheEngine keyed worker_id = its TP rank,
and stores and loads only its own shard (its KV heads). The scheduler side owns none: it
asks every rank's lookup service (kvcache.lookup, ZMQ) and a prefix counts as far as the
rank holding the least of it. TP=1 takes the same path, with one rank to ask.

Scheduler side: a waiting request's tokens are looked up on every rank (pinning the
chunks there under the request id); the hit, cut to leave the last prompt token to
compute and rounded down to whole blocks, is what the request loads. As prefill (and, with
save_decode_cache, decode) completes whole chunks, they are planned for saving; a short last
prompt chunk only with save_unfull_chunk. Pins are released when the load runs, when no load
is planned, and in request_finished (whatever happened before): the scheduler sends
those releases to the workers in the next step's metadata.

Worker side: the tier's KV shape is [num_layers, 2, num_tokens, kv_heads, head_size]; this
connector gathers it from, and scatters it into, the paged caches ([2, num_blocks,
block_size, kv_heads, head_size] per layer) through token slots, each layer through the
block table of its KV cache group. Sliding-window groups are served when the window is
wider than a chunk: a chunk is saved in the step that completes it, before any of its
blocks leaves the window; chunks whose blocks a window already dropped (a local prefix
hit holds null blocks there) are not saved. Loads run in start_load_kv,
or in a background thread with enable_async_loading (the request waits in
WAITING_FOR_REMOTE_KVS until get_finished reports it). Saves run in wait_for_save. Tokens
a load could not bring back are reported as load errors: the scheduler recomputes them.
Under TP the ranks agree (a gloo all-gather, in steps that load) on how far every rank
loaded and on which async loads every rank finished, so each reports the same thing and
no rank computes on a head another rank failed to bring back.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from kvserve.distributed.kv_transfer.kv_connector.base import (
    ConnectorBlocks,
    ConnectorRequest,
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
)
from kvserve.distributed.kv_transfer.kv_connector.utils import (
    check_connector_layout,
    follow_scheduled_blocks,
    layer_to_group,
)
from kvserve.kvcache.builder import CacheEngineBuilder
from kvserve.kvcache.config import load_cache_engine_config
from kvserve.kvcache.key import CacheEngineMetadata
from kvserve.kvcache.lookup import EngineStats, LookupClient, LookupServer, lookup_address

if TYPE_CHECKING:
    import torch

    from kvserve.config import EngineConfig
    from kvserve.forward_context import ForwardContext
    from kvserve.kvcache.cache_engine import CacheEngine
    from kvserve.protocol.kv_cache_interface import KVCacheConfig
    from kvserve.protocol.scheduler_output import SchedulerOutput

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


@dataclass
class _Tracked:
    request: ConnectorRequest
    block_ids: list[list[int]]
    saved_upto: int  # tokens from 0 the tier holds (or was asked to store) for this request


def _tags(cache_salt: str | None) -> tuple[tuple[str, str], ...]:
    return () if cache_salt is None else (("salt", cache_salt),)


class TieredCacheConnector(KVConnectorBase_V1):
    @classmethod
    def check_parallel_config(cls, config: EngineConfig) -> None:
        parallel = config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise ValueError("TieredCacheConnector does not support pipeline_parallel_size > 1 yet")
        if parallel.world_size > 1 and parallel.distributed_executor_backend == "ray":
            # The lookup service is reached over ipc sockets: every rank on this machine.
            raise ValueError(
                "TieredCacheConnector with tensor_parallel_size > 1 needs "
                "distributed_executor_backend 'mp' (its lookup service is local to the machine)"
            )

    def __init__(
        self,
        config: EngineConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(config, role, kv_cache_config)
        self.cache_config = load_cache_engine_config(
            self.kv_transfer_config.kv_connector_extra_config
        )
        self.block_size = config.cache_config.block_size
        self.chunk_size = self.cache_config.chunk_size
        if self.chunk_size % self.block_size:
            raise ValueError(
                f"chunk_size ({self.chunk_size}) must be a multiple of block_size ({self.block_size})"
            )
        windows = check_connector_layout(kv_cache_config, "TieredCacheConnector", self.chunk_size)
        groups = kv_cache_config.kv_cache_groups if kv_cache_config else []
        if any(g.kv_cache_spec.kind == "mla_attention" for g in groups):
            # The tier's chunks are [layers, 2, tokens, kv heads, head size]; a latent is none.
            raise ValueError("TieredCacheConnector cannot serve MLA latent caches yet")
        # Groups whose block tables hold null blocks where a window dropped tokens.
        self._windowed_groups = [
            g
            for g, group in enumerate(kv_cache_config.kv_cache_groups if kv_cache_config else [])
            if getattr(group.kv_cache_spec, "sliding_window", None) in windows
        ]
        self._layer_group = layer_to_group(kv_cache_config)
        self.world_size = config.parallel_config.world_size
        self._instance_id = f"{self.kv_transfer_config.engine_id}"
        self.async_loading = self.cache_config.enable_async_loading
        # Worker side: this rank's CacheEngine and the lookup service over it.
        self._engine: CacheEngine | None = None
        self._lookup_server: LookupServer | None = None
        # Scheduler side: the client of every rank's lookup service.
        self._lookup_client: LookupClient | None = None
        if role == KVConnectorRole.WORKER:
            from kvserve.distributed.parallel_state import get_tp_group

            self._tp = get_tp_group()
            metadata = CacheEngineMetadata(
                model_name=config.model_config.resolved.name,
                world_size=self.world_size,
                worker_id=self._tp.rank_in_group,
                kv_dtype=config.cache_config.kv_dtype(config.model_config.dtype),
            )
            self._engine = CacheEngineBuilder.get_or_create(
                self._instance_id, self.cache_config, metadata
            )
            self._lookup_address = lookup_address(self._instance_id, self._tp.rank_in_group)
            self._lookup_server = LookupServer.acquire(self._engine, self._lookup_address)
        else:
            self._lookup_client = LookupClient(
                [lookup_address(self._instance_id, rank) for rank in range(self.world_size)]
            )
        # Scheduler side.
        self._lookups: dict[str, tuple[int, int]] = {}  # req_id -> (tier hit, usable tokens)
        self._tracked: dict[str, _Tracked] = {}
        self._pending_loads: list[TransferSpec] = []
        self._pinned: set[str] = set()  # looked up: some rank may hold pins for it
        self._releases: list[str] = []
        self._lookup_tokens = {"query": 0.0, "hit": 0.0}
        self._rank_stats: list[EngineStats] = []
        self._stats_stale = 1  # stats calls that must ask the ranks again
        # Worker side: (cache, KV cache group) per layer in model order.
        self._kv_caches: list[tuple[torch.Tensor, int]] = []
        self._loader: ThreadPoolExecutor | None = None
        self._async_loads: dict[str, tuple[TransferSpec, Future[int]]] = {}
        self._load_errors: set[int] = set()

    @property
    def engine(self) -> CacheEngine:
        """The worker side's CacheEngine (this rank's shard)."""
        if self._engine is None:
            raise RuntimeError("only the worker side of TieredCacheConnector owns a CacheEngine")
        return self._engine

    # ---- scheduler side --------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self._lookups.pop(request.request_id, None)
        if not self.kv_transfer_config.is_kv_consumer:
            return 0, False
        tokens = request.all_token_ids
        assert self._lookup_client is not None
        hit = self._lookup_client.lookup(tokens, request.request_id, _tags(request.cache_salt))
        self._pinned.add(request.request_id)
        self._lookup_tokens["query"] += len(tokens)
        self._lookup_tokens["hit"] += hit
        self._stats_stale = 2
        # A full hit still recomputes the last token (its logits pick the next token), and
        # the scheduler takes whole blocks.
        usable = min(hit, len(tokens) - 1) // self.block_size * self.block_size
        self._lookups[request.request_id] = (hit, usable)
        if usable <= num_computed_tokens:
            self._release(request.request_id)
            return 0, False
        return usable - num_computed_tokens, self.async_loading

    def update_state_after_alloc(
        self, request: ConnectorRequest, blocks: ConnectorBlocks, num_external_tokens: int
    ) -> None:
        block_ids = [list(ids) for ids in blocks.get_block_ids()]
        hit, usable = self._lookups.pop(request.request_id, (0, 0))
        self._tracked[request.request_id] = _Tracked(request, block_ids, hit)
        if num_external_tokens <= 0:
            self._release(request.request_id)
            return
        self._pinned.discard(request.request_id)  # each rank's retrieve releases its pins
        start = usable - num_external_tokens
        self._pending_loads.append(
            TransferSpec(
                request.request_id,
                list(request.all_token_ids[:usable]),
                start,
                usable,
                [ids[: -(-usable // self.block_size)] for ids in block_ids],
                _tags(request.cache_salt),
            )
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = TieredCacheConnectorMetadata(loads=self._pending_loads, releases=self._releases)
        self._pending_loads, self._releases = [], []
        scheduled = follow_scheduled_blocks(scheduler_output, self._tracked)
        if self.kv_transfer_config.is_kv_producer:
            for req_id, computed in scheduled:
                spec = self._plan_save(
                    req_id, computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
                )
                if spec is not None:
                    meta.saves.append(spec)
        if meta.loads or meta.saves:
            self._stats_stale = 2  # this step and the next change the tiers' counters
        return meta

    def _release(self, req_id: str) -> None:
        if req_id in self._pinned:
            self._pinned.discard(req_id)
            self._releases.append(req_id)

    def _plan_save(self, req_id: str, computed_after: int) -> TransferSpec | None:
        """The chunks whose KV is complete once this step ran and that were not saved yet."""
        tracked = self._tracked.get(req_id)
        if tracked is None:
            return None
        request = tracked.request
        num_prompt = len(request.prompt_token_ids)
        limit = (
            computed_after
            if self.cache_config.save_decode_cache
            else min(computed_after, num_prompt)
        )
        end = limit // self.chunk_size * self.chunk_size
        if self.cache_config.save_unfull_chunk and computed_after >= num_prompt:
            end = max(end, num_prompt)  # the prompt's short last chunk
        if end <= tracked.saved_upto:
            return None
        start = tracked.saved_upto // self.chunk_size * self.chunk_size
        tracked.saved_upto = end
        num_blocks = -(-end // self.block_size)
        blocks = [ids[:num_blocks] for ids in tracked.block_ids]
        if any(0 in blocks[g][start // self.block_size :] for g in self._windowed_groups):
            # A window dropped some of these tokens before this request computed them (a
            # local prefix hit brought null blocks): the tier would store garbage there.
            return None
        tokens = list(request.all_token_ids[:end])
        return TransferSpec(req_id, tokens, start, end, blocks, _tags(request.cache_salt))

    def request_finished(
        self, request: ConnectorRequest, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        # Whatever happened (aborted before loading, load failed), the pins go now.
        self._release(request.request_id)
        self._tracked.pop(request.request_id, None)
        self._lookups.pop(request.request_id, None)
        return False, None

    # ---- worker side -----------------------------------------------------------------------

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
        """The minimum of each value over the TP ranks. Every rank calls it at the same
        point with as many values (they follow the same metadata), so the collective
        always matches up; one rank alone keeps its values."""
        if self.world_size == 1 or not values:
            return values
        import torch

        gathered = self._tp.all_gather(torch.tensor(values, dtype=torch.int64), dim=0)
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

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if connector_output.finished_recving:
            self._stats_stale = 2

    def get_kv_connector_stats(self) -> dict[str, dict[str, float]]:
        # The tiers' counters live in the workers: ask them again only after steps that
        # may have changed them (this runs once per step when stats are logged).
        if self._stats_stale and self._lookup_client is not None:
            self._rank_stats = self._lookup_client.stats()
            self._stats_stale -= 1
        stats: dict[str, dict[str, float]] = {}
        for rank in self._rank_stats:  # summed over ranks: each stores its own shard
            for tier, counts in rank.tiers.items():
                for metric, value in msgspec.structs.asdict(counts).items():
                    per_tier = stats.setdefault(f"tier_{metric}", {})
                    per_tier[tier] = per_tier.get(tier, 0) + value
            for name in ("store_latency", "retrieve_latency"):
                count, total = getattr(rank, name)
                agg = stats.setdefault(f"{name}_seconds", {"count": 0, "sum": 0.0})
                agg["count"] += count
                agg["sum"] += total
        stats["lookup_tokens"] = dict(self._lookup_tokens)
        return stats

    def shutdown(self) -> None:
        if self._lookup_client is not None:
            self._lookup_client.close()
            self._lookup_client = None
        if self._engine is None:
            return
        if self._loader is not None:
            self._loader.shutdown(wait=True)
            self._loader = None
        if self._lookup_server is not None:
            LookupServer.release(self._lookup_address)
            self._lookup_server = None
        # Queued disk writes land before the process may exit.
        self._engine.flush(timeout=60)
        CacheEngineBuilder.release(self._instance_id)
        self._engine = None
