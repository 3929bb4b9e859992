"""TieredCacheConnector: the engine's paged KV cache in front of the kvcache tier.

Roles: the worker side on each rank owns a CacheEngine keyed worker_id = its global rank
(pp_stage * tp_size + tp_rank), and stores and loads only its own shard (its KV heads of
its stage's layers). The scheduler side owns none: it
asks every rank's lookup service (kvcache.lookup, ZMQ) and a prefix counts as far as the
rank holding the least of it. TP=1 takes the same path, with one rank to ask.

Scheduler side: a waiting request's tokens are looked up on every rank (pinning the
chunks there under the request id); the hit, cut to leave the last prompt token to
compute and rounded down to whole blocks, is what the request loads. As prefill (and, with
save_decode_cache, decode) completes whole chunks, they are planned for saving; a short last
prompt chunk only with save_unfull_chunk. Pins are released when the load runs, when no load
is planned, and in request_finished (whatever happened before): the scheduler sends
those releases to the workers in the next step's metadata.

Worker side (tiered_cache_worker.py): loads in start_load_kv (or a background thread with
enable_async_loading), saves in wait_for_save, each rank its own KV heads of its own
layers; under TP and PP the whole world agrees on how far every rank loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
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
from kvserve.distributed.kv_transfer.kv_connector.connectors.tiered_cache_worker import (
    TieredCacheConnectorMetadata,
    TieredCacheWorker,
    TransferSpec,
)
from kvserve.distributed.kv_transfer.kv_connector.utils import (
    check_connector_layout,
    follow_scheduled_blocks,
    layer_to_group,
)
from kvserve.kvcache.config import load_cache_engine_config
from kvserve.kvcache.integrity import kv_authenticator, read_secret
from kvserve.kvcache.lookup import EngineStats, LookupClient, lookup_address
from kvserve.protocol.kv_blend import BlendSpec, parse_blend_params
from kvserve.utils.zmq_curve import socket_security

if TYPE_CHECKING:
    from kvserve.config import EngineConfig
    from kvserve.protocol.kv_cache_interface import KVCacheConfig
    from kvserve.protocol.scheduler_output import SchedulerOutput

__all__ = ["TieredCacheConnector", "TieredCacheConnectorMetadata", "TransferSpec"]


@dataclass
class _Tracked:
    request: ConnectorRequest
    block_ids: list[list[int]]
    saved_upto: int  # tokens from 0 the tier holds (or was asked to store) for this request
    # CacheBlend's recompute ratio; None: a plain request (prefix chunks in, prefix out).
    blend_ratio: float | None = None


def _tags(cache_salt: str | None) -> tuple[tuple[str, str], ...]:
    return () if cache_salt is None else (("salt", cache_salt),)


class TieredCacheConnector(TieredCacheWorker, KVConnectorBase_V1):
    @classmethod
    def check_parallel_config(cls, config: EngineConfig) -> None:
        return None  # any TP x PP: each rank is its own worker_id

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
        self._lookup_client: LookupClient | None = None
        # Both roles check: the scheduler side fails at start, before any worker runs.
        remote, control = self.cache_config.remote_url, self.cache_config.control_endpoint
        # KV can enter from the remote store, and through the control service (a cache
        # controller's move imports chunks): either needs the secret's MAC.
        shared = [
            *([f"the KV tier's {remote}"] if remote else []),
            *([f"the KV tier's control service {control}"] if control else []),
        ]
        auth = kv_authenticator(config.kv_security_config, " and ".join(shared) or None)
        self._security = socket_security(read_secret(config.kv_security_config))
        if role == KVConnectorRole.WORKER:
            self._init_worker(config, self.cache_config, auth)
        else:
            # The CacheEngines live with the workers: ask every rank's lookup service.
            self._lookup_client = LookupClient(
                [lookup_address(self._instance_id, rank) for rank in range(self.world_size)],
                security=self._security,
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

    # ---- scheduler side --------------------------------------------------------------------

    def set_xfer_handshake_metadata(self, metadata: dict[int, dict[str, str]]) -> None:
        """Ranks that listen on TCP (Ray) say where; the others keep their ipc path."""
        if self._lookup_client is None:
            return
        addresses = [
            metadata.get(rank, {}).get("lookup_address", address)
            for rank, address in enumerate(self._lookup_client.addresses)
        ]
        if addresses != self._lookup_client.addresses:
            self._lookup_client.close()
            self._lookup_client = LookupClient(addresses, security=self._security)

    def _blend_ratio(self, request: ConnectorRequest) -> float | None:
        """The request's recompute ratio when it is blended, else None."""
        params = parse_blend_params(request.kv_transfer_params)
        enabled = self.cache_config.enable_blending if params.enabled is None else params.enabled
        if not enabled:
            return None
        if params.recompute_ratio is not None:
            return params.recompute_ratio
        return self.cache_config.blend_recompute_ratio

    def computes_exact_kv(self, request: ConnectorRequest) -> bool:
        return self._blend_ratio(request) is None

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self._lookups.pop(request.request_id, None)
        if not self.kv_transfer_config.is_kv_consumer:
            return 0, False
        if self._blend_ratio(request) is not None:
            # A blended prompt finds its KV segment by segment when its prefill runs (the
            # worker side); no prefix of it is loaded here.
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
        self._tracked[request.request_id] = _Tracked(
            request, block_ids, hit, self._blend_ratio(request)
        )
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
        for req_id, computed in scheduled:
            blend = self._plan_blend(
                req_id, computed, scheduler_output.num_scheduled_tokens.get(req_id, 0)
            )
            if blend is not None:
                meta.blends.append(blend)
        if self.kv_transfer_config.is_kv_producer:
            for req_id, computed in scheduled:
                spec = self._plan_save(
                    req_id, computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
                )
                if spec is not None:
                    meta.saves.append(spec)
        if meta.loads or meta.saves or meta.blends:
            self._stats_stale = 2  # this step and the next change the tiers' counters
        return meta

    def _release(self, req_id: str) -> None:
        if req_id in self._pinned:
            self._pinned.discard(req_id)
            self._releases.append(req_id)

    def _plan_blend(self, req_id: str, computed: int, num_scheduled: int) -> BlendSpec | None:
        """A blended request's prefill step, whole or one chunk of it: the segments that
        lie wholly inside the step are blended (one that a chunk boundary cuts is computed
        in full). A recompute after preemption, outputs included, is computed in full."""
        tracked = self._tracked.get(req_id)
        if tracked is None or tracked.blend_ratio is None:
            return None
        prompt = tracked.request.prompt_token_ids
        end = computed + num_scheduled
        if num_scheduled < 2 or end > len(prompt):
            return None
        request = tracked.request
        return BlendSpec(
            req_id, list(prompt), computed, end, tracked.blend_ratio, _tags(request.cache_salt)
        )

    def _plan_save(self, req_id: str, computed_after: int) -> TransferSpec | None:
        """The chunks whose KV is complete once this step ran and that were not saved yet."""
        tracked = self._tracked.get(req_id)
        if tracked is None or tracked.blend_ratio is not None:
            # A blended request's prefix KV is approximate: only its segments are stored.
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
        self._shutdown_worker()
