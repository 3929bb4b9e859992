"""CacheBlend in the model runner: position-independent segment KV in and out of the
tier, and the step's token selection (blend_selection.py).

For each request the tiered connector's scheduler side marks as blended (its whole
remaining prompt runs in this step), the prompt is split at the separator tokens into
segments (kvserve.protocol.kv_blend.split_segments). Each segment is found in the tier
by its own tokens, whatever precedes it. Segment KV is stored with its keys rotated back
to position 0 and rotated forward to wherever the segment now starts (rotations compose:
exact algebra, float32 rounding ~1e-6). Loaded KV goes into the paged cache of the layers
after the check layer; the check layer's loaded copy is kept to pick the tokens to
recompute. Segments that were not in the tier are stored once the step's forward wrote
their KV (computed in full, attending to what preceded them).

Recompute ratio 1.0 loads nothing and recomputes everything: exactly a full prefill.

Without a blending-capable connector the runner holds the no-op ``BlendRunner``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.config import EngineConfig
from kvserve.distributed.kv_transfer.kv_connector.base import KVConnectorBase_V1
from kvserve.distributed.kv_transfer.kv_connector.connectors.tiered_cache import (
    TieredCacheConnector,
)
from kvserve.distributed.parallel_state import GroupCoordinator, get_tp_group
from kvserve.forward_context import ForwardContext
from kvserve.kvcache.cache_engine import CacheEngine
from kvserve.model_executor.layers.rotary_embedding import RotaryEmbedding
from kvserve.protocol.kv_blend import BlendSpec, split_segments
from kvserve.protocol.kv_cache_interface import KVCacheConfig
from kvserve.protocol.scheduler_output import SchedulerOutput
from kvserve.worker.blend_selection import BlendSelection, CachedTokens
from kvserve.worker.input_batch import InputBatch
from kvserve.worker.input_preparation import StepInputs

logger = logging.getLogger(__name__)


@dataclass
class BlendStats:
    """Running totals since start (segments found / not found, cached tokens reused /
    recomputed)."""

    segment_hits: int = 0
    segment_misses: int = 0
    tokens_reused: int = 0
    tokens_recomputed: int = 0


class BlendRunner:
    """The no-op form: no request is blended."""

    stats: BlendStats = BlendStats()

    def begin_step(
        self,
        context: ForwardContext,
        scheduler_output: SchedulerOutput,
        batch: InputBatch,
        inputs: StepInputs,
    ) -> None:
        """Inside the forward context, before the forward: loads and plans the step."""

    def end_step(self) -> None:
        """After the forward: stores the segments the step computed."""


@dataclass
class _Store:
    tokens: list[int]
    start: int  # the segment's first position in this prompt
    slots: torch.Tensor
    tags: tuple[tuple[str, str], ...]


@dataclass
class _StepPlan:
    cached: list[CachedTokens] = field(default_factory=list)
    stores: list[_Store] = field(default_factory=list)
    selection: BlendSelection | None = None


class SegmentKV:
    """Segment KV between the paged caches and the tier, moved to and from position 0."""

    def __init__(
        self, engine: CacheEngine, caches: list[torch.Tensor], rotary: RotaryEmbedding
    ) -> None:
        self.engine = engine
        self.caches = caches  # per attention layer, model order
        self.rotary = rotary

    def _move(self, kv: torch.Tensor, delta: int) -> torch.Tensor:
        """kv [layers, 2, n, heads, head size] with its keys rotated by delta positions."""
        out = kv.clone()
        n = kv.shape[2]
        shift = torch.full((n,), delta, dtype=torch.int64, device=kv.device)
        for layer in range(kv.shape[0]):
            out[layer, 0] = self.rotary.rotate_by(kv[layer, 0].float(), shift).to(kv.dtype)
        return out

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """[layers, 2, n, heads, head size] of the given cache slots."""
        return torch.stack(
            [cache.view(2, -1, *cache.shape[-2:])[:, slots] for cache in self.caches]
        )

    def store(self, tokens: list[int], start: int, slots: torch.Tensor, tags: Any) -> None:
        self.engine.store_segment(tokens, self._move(self.gather(slots), -start), tags)

    def load(self, tokens: list[int], start: int, tags: Any) -> torch.Tensor | None:
        """The segment's KV for positions start.. (None: not in the tier)."""
        kv = self.engine.retrieve_segment(tokens, tags)
        if kv is None:
            return None
        return self._move(kv.to(self.caches[0].device), start)


@dataclass
class _Segment:
    spec: BlendSpec
    start: int
    tokens: list[int]
    rows: torch.Tensor  # the segment's rows in the step's batch
    slots: torch.Tensor
    kv: torch.Tensor | None  # loaded and moved to start (None: not loaded)
    found: bool


class ActiveBlendRunner(BlendRunner):
    def __init__(
        self,
        segments: SegmentKV,
        separator: list[int],
        check_layer: int,
        tp_group: GroupCoordinator,
    ) -> None:
        self.segments = segments
        self.separator = separator
        self.check_layer = check_layer
        self.stats = BlendStats()
        # Each TP rank holds its own KV heads: ranks agree on which segments are reused
        # and sum their deviations, so all select the same tokens.
        self._tp_group = tp_group
        self._plan: _StepPlan | None = None

    def begin_step(
        self,
        context: ForwardContext,
        scheduler_output: SchedulerOutput,
        batch: InputBatch,
        inputs: StepInputs,
    ) -> None:
        blends: list[BlendSpec] = getattr(scheduler_output.kv_connector_metadata, "blends", [])
        if not blends:
            return
        slot_mapping = inputs.common_attn_metadata[0].slot_mapping
        found: list[_Segment] = []
        for spec in blends:
            row = batch.req_id_to_index.get(spec.req_id)
            if row is None or int(inputs.num_scheduled_tokens[row]) != spec.end - spec.start:
                continue  # not this step's shape after all: computed in full (exact)
            first_row = int(inputs.query_start_loc_np[row]) - spec.start
            found += self._find(spec, first_row, slot_mapping)
        everywhere = self._agree([int(seg.found) for seg in found])
        plan = _StepPlan()
        by_request: dict[str, list[_Segment]] = {}
        for seg, ok in zip(found, everywhere, strict=True):
            if not ok:
                self.stats.segment_misses += 1
                plan.stores.append(_Store(seg.tokens, seg.start, seg.slots, seg.spec.tags))
                continue
            self.stats.segment_hits += 1
            if seg.kv is not None:
                self._place(seg.kv, seg.slots)
                by_request.setdefault(seg.spec.req_id, []).append(seg)
        for segs in by_request.values():
            rows = torch.cat([seg.rows for seg in segs])
            loaded = torch.cat([seg.kv[self.check_layer] for seg in segs if seg.kv is not None], 1)
            plan.cached.append(
                CachedTokens(rows, slot_mapping[rows], loaded, segs[0].spec.recompute_ratio)
            )
        self._plan = plan
        if plan.cached:
            plan.selection = BlendSelection(
                context,
                self.check_layer,
                self.segments.caches[self.check_layer],
                plan.cached,
                int(inputs.query_start_loc_np[batch.num_reqs]),
                self._tp_group,
            )
            context.token_selector = plan.selection

    def _find(self, spec: BlendSpec, first_row: int, slot_mapping: torch.Tensor) -> list[_Segment]:
        """The request's segments computed in this step, loaded where the tier has them
        (ratio 1.0 loads nothing: it only finds out which ones need storing)."""
        segments = []
        for s, e in split_segments(spec.token_ids, self.separator):
            if s < spec.start:
                continue  # KV the cache held before this step (a local prefix hit)
            if e > spec.end:
                break  # not wholly in this chunk of the prefill: computed in full
            tokens = spec.token_ids[s:e]
            rows = torch.arange(first_row + s, first_row + e, device=slot_mapping.device)
            if spec.recompute_ratio >= 1.0:
                kv = None
                hit = self.segments.engine.contains_segment(tokens, spec.tags)
            else:
                kv = self.segments.load(tokens, s, spec.tags)
                hit = kv is not None
            segments.append(_Segment(spec, s, tokens, rows, slot_mapping[rows], kv, hit))
        return segments

    def _place(self, kv: torch.Tensor, slots: torch.Tensor) -> None:
        """Loaded KV into the layers after the check layer; the check layer's copy stays
        aside (its cache gets the fresh K/V first)."""
        for layer in range(self.check_layer + 1, len(self.segments.caches)):
            cache = self.segments.caches[layer]
            cache.view(2, -1, *cache.shape[-2:]).index_copy_(1, slots, kv[layer].to(cache.dtype))

    def _agree(self, flags: list[int]) -> list[int]:
        """Each flag's minimum over the TP ranks (every rank has the same segments)."""
        if self._tp_group.world_size == 1 or not flags:
            return flags
        gathered = self._tp_group.all_gather(torch.tensor(flags, dtype=torch.int64), dim=0)
        return gathered.view(self._tp_group.world_size, -1).min(dim=0).values.tolist()

    def end_step(self) -> None:
        plan, self._plan = self._plan, None
        if plan is None:
            return
        if plan.selection is not None:
            self.stats.tokens_recomputed += plan.selection.num_recomputed
            self.stats.tokens_reused += plan.selection.num_reused
        for store in plan.stores:
            try:
                self.segments.store(store.tokens, store.start, store.slots, store.tags)
            except Exception:  # a failed save loses a cache entry, never a request
                logger.exception("storing a blend segment failed")


NO_BLEND_RUNNER = BlendRunner()


def _rotary_of(model: Any) -> RotaryEmbedding | None:
    ropes = {id(m): m for m in model.modules() if type(m) is RotaryEmbedding}
    return next(iter(ropes.values())) if len(ropes) == 1 else None


def make_blend_runner(
    config: EngineConfig,
    model: Any,
    kv_cache_config: KVCacheConfig,
    kv_caches: dict[str, torch.Tensor],
    connector: KVConnectorBase_V1 | None,
) -> BlendRunner:
    """The active runner where the tiered connector runs with a model blending supports;
    ValueError when enable_blending asks for it where it cannot run. Without
    enable_blending a request's own ``"blend": true`` is then computed in full."""
    if not isinstance(connector, TieredCacheConnector):
        return NO_BLEND_RUNNER
    cache_config = connector.cache_config
    problem = _unsupported(config, model, kv_cache_config)
    separator = None
    if problem is None:
        separator = cache_config.blend_separator_token_ids()
        if separator is None:
            if config.model_config.skip_tokenizer_init:
                problem = "a model without a tokenizer needs blend_separator_ids"
            else:
                from kvserve.transformers_utils.tokenizer import get_tokenizer

                try:
                    tokenizer = get_tokenizer(config.model_config.resolved)
                    separator = list(
                        tokenizer.encode(cache_config.blend_special_str, add_special_tokens=False)
                    )
                except Exception as exc:  # no usable tokenizer: blending is off
                    problem = f"cannot tokenize blend_special_str: {exc}"
                if separator == []:
                    problem = "blend_special_str tokenizes to nothing"
    if problem is not None or separator is None:
        if cache_config.enable_blending:
            raise ValueError(f"kv_connector_extra_config.enable_blending: {problem}")
        return NO_BLEND_RUNNER
    rotary = _rotary_of(model)
    assert rotary is not None
    num_layers = len(kv_caches)
    check_layer = min(cache_config.blend_check_layer, num_layers - 1)
    segments = SegmentKV(connector.engine, list(kv_caches.values()), rotary)
    return ActiveBlendRunner(segments, separator, check_layer, get_tp_group())


def _unsupported(config: EngineConfig, model: Any, kv_cache_config: KVCacheConfig) -> str | None:
    """Why blending cannot run here, or None."""
    from kvserve.model_executor.models.llama import LlamaModel

    if config.parallel_config.pipeline_parallel_size > 1:
        return "CacheBlend does not run with pipeline parallelism yet"
    if not isinstance(getattr(model, "model", None), LlamaModel):
        return "CacheBlend needs a Llama-family model (its layer loop selects the tokens)"
    if len(kv_cache_config.kv_cache_groups) != 1:
        return "CacheBlend needs one KV cache group (no sliding-window or hybrid layers)"
    rotary = _rotary_of(model)
    if rotary is None or not rotary.is_pure_rotation:
        return "CacheBlend needs one plain rotary embedding (not YaRN) to move keys"
    if config.speculative_config is not None:
        return "CacheBlend does not run with speculative decoding"
    from kvserve.attention.layer import get_attention_layers

    # Both take a position per query, which the selected tokens need.
    if any(
        layer.backend.get_name() not in ("CPU_ATTN", "TRITON")
        for layer in get_attention_layers(model).values()
    ):
        return "CacheBlend runs on the CPU_ATTN and TRITON attention backends only"
    return None
