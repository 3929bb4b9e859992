"""The scheduler's side of multimodal models: encoder work under an encoder compute budget
beside the token budget, encoder outputs in the EncoderCacheManager (vLLM's
``_try_schedule_encoder_inputs``).

A request's prompt chunk [num_computed, num_computed + num_new) needs the encoder output
of every item whose placeholder range it overlaps and that is not in the KV cache yet. An
output the cache holds (the same image in another request, or in an earlier chunk of
this one) is shared; otherwise the item's encoder runs in this step if the step's
encoder budget and the cache have room, else the chunk stops before the item.

Models whose image tokens attend to each other both ways (Gemma 3) cannot compute part
of an image: a chunk that would end inside one stops at the image's start instead, and a
chunk that starts inside one (after a prefix-cache hit) must reach its end or waits for a
step with enough budget. Other models may cut an image anywhere; its output stays cached
until the chunk that computes its last position.

``NoEncoderPlanner`` is the planner of a text-only model: no request has items, so every
chunk is scheduled as asked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from kvserve.core.encoder_cache_manager import EncoderCacheManager
from kvserve.multimodal.processor_cache import ProcessorCache
from kvserve.protocol.engine_core import MultiModalStats

if TYPE_CHECKING:
    from kvserve.config import EngineConfig, MultiModalConfig
    from kvserve.core.request import Request
    from kvserve.protocol.mm_inputs import MultiModalFeatureSpec
    from kvserve.protocol.runner_output import ModelRunnerOutput
    from kvserve.transformers_utils.multimodal_arch import MultiModalArch


class NoEncoderPlanner:
    """A text-only model's: no encoder, no encoder cache."""

    max_num_encoder_input_tokens = 0

    def receive_features(
        self, features: list[MultiModalFeatureSpec], architecture: str
    ) -> list[MultiModalFeatureSpec]:
        """A request's items as the front end sent them, with the data of items sent as
        their hash alone restored (EngineCore.add_request)."""
        raise ValueError(f"{architecture} takes no images")

    def check_request(self, request: Request) -> None:
        """Raises ValueError for items the scheduler could never fit (add_request)."""
        if request.mm_features:
            raise ValueError("this model takes no multimodal input (mm_features given)")

    def try_schedule(
        self, request: Request, num_computed: int, num_new: int, encoder_budget: int
    ) -> tuple[list[int], int, int]:
        return [], num_new, encoder_budget

    def allocate(self, request: Request, input_ids: list[int]) -> list[int]:
        return input_ids

    def free_computed(self, request: Request) -> None:
        pass

    def free(self, request: Request) -> None:
        pass

    def take_freed_hashes(self) -> list[str]:
        return []

    def record(self, output: ModelRunnerOutput) -> None:
        pass

    def make_stats(self) -> MultiModalStats | None:
        return None

    def request_census(self) -> dict[str, int]:
        return {}

    def check_integrity(self) -> None:
        pass


class EncoderPlanner(NoEncoderPlanner):
    def __init__(
        self,
        multimodal_config: MultiModalConfig,
        mm_arch: MultiModalArch,
        max_num_scheduled_tokens: int,
    ) -> None:
        self.max_num_scheduled_tokens = max_num_scheduled_tokens
        self.mm_split_items = not mm_arch.bidirectional_items
        # The mirror of the front end's processor cache (EngineCore.add_request fills
        # each request's items from it).
        self.processor_cache = ProcessorCache(multimodal_config.processor_cache_bytes)
        size = multimodal_config.encoder_cache_size or max(
            max_num_scheduled_tokens, mm_arch.max_tokens_per_item
        )
        self.max_num_encoder_input_tokens = size
        self.cache = EncoderCacheManager(size)
        self.mm_stats = MultiModalStats()
        # (request, item) pairs counted as encoder cache queries: once each, however many
        # steps a request waits before it runs.
        self._mm_counted: set[tuple[str, int]] = set()

    @staticmethod
    def create(config: EngineConfig) -> NoEncoderPlanner:
        mm_arch = config.model_config.arch.multimodal
        if mm_arch is None:
            return NoEncoderPlanner()
        if mm_arch.encoder_decoder:
            return CrossAttentionEncoderPlanner(
                config.multimodal_config, mm_arch, config.scheduler_config.max_num_batched_tokens
            )
        return EncoderPlanner(
            config.multimodal_config, mm_arch, config.scheduler_config.max_num_batched_tokens
        )

    def receive_features(
        self, features: list[MultiModalFeatureSpec], architecture: str
    ) -> list[MultiModalFeatureSpec]:
        # First, whatever follows: the mirror moves with every request the front end
        # sent, as the front end's cache did.
        return self.processor_cache.receive(features)

    def check_request(self, request: Request) -> None:
        for i, feature in enumerate(request.mm_features):
            length = feature.mm_position.length
            if length > self.max_num_encoder_input_tokens:
                raise ValueError(
                    f"multimodal item {i} spans {length} tokens, more than the encoder cache "
                    f"({self.max_num_encoder_input_tokens})"
                )
            if not self.mm_split_items and length > self.max_num_scheduled_tokens:
                raise ValueError(
                    f"image {i} spans {length} tokens, more than max_num_batched_tokens "
                    f"({self.max_num_scheduled_tokens}); this model computes an image in one step"
                )

    def try_schedule(
        self, request: Request, num_computed: int, num_new: int, encoder_budget: int
    ) -> tuple[list[int], int, int]:
        """Returns (items whose encoder runs this step, the possibly shortened num_new,
        the encoder budget left)."""
        manager = self.cache
        if not request.mm_features or num_new <= 0:
            return [], num_new, encoder_budget
        to_schedule: list[int] = []
        num_embeds = 0
        for i, feature in enumerate(request.mm_features):
            start, length = feature.mm_position.offset, feature.mm_position.length
            end = num_computed + num_new
            if start >= end:
                break  # this and later items lie beyond the chunk
            if start + length <= num_computed:
                continue  # already in the KV cache
            if not self.mm_split_items and end < start + length:
                # The chunk would end inside a bidirectional image: stop before it.
                num_new = max(start - num_computed, 0)
                break
            if manager.check_and_update_cache(request, i):
                self._count_query(request, i, hit=True)
                continue
            if not manager.can_allocate(request, i, encoder_budget, num_embeds):
                num_new = max(start - num_computed, 0)
                break
            self._count_query(request, i, hit=False)
            num_embeds += length
            encoder_budget -= length
            to_schedule.append(i)
        return to_schedule, num_new, encoder_budget

    def _count_query(self, request: Request, input_id: int, hit: bool) -> None:
        key = (request.request_id, input_id)
        if key in self._mm_counted:
            return
        self._mm_counted.add(key)
        self.mm_stats.encoder_cache_queries += 1
        self.mm_stats.encoder_cache_hits += hit

    def allocate(self, request: Request, input_ids: list[int]) -> list[int]:
        """Reserves the scheduled items' cache space once the request is scheduled; an
        item that appears twice in the request is encoded once."""
        manager = self.cache
        scheduled = []
        for i in input_ids:
            if manager.check_and_update_cache(request, i):
                continue  # an earlier item of this request had the same hash
            manager.allocate(request, i)
            scheduled.append(i)
        return scheduled

    def free_computed(self, request: Request) -> None:
        """Drops the request's hold on outputs whose whole range is in the KV cache now."""
        manager = self.cache
        if not request.mm_features:
            return
        for i in sorted(manager.get_cached_input_ids(request)):
            position = request.mm_features[i].mm_position
            if position.offset + position.length <= request.num_computed_tokens:
                manager.free_encoder_input(request, i)

    def free(self, request: Request) -> None:
        if request.mm_features:
            self.cache.free(request)
            # A preempted request asks again when it resumes (its outputs may be gone).
            for i in range(len(request.mm_features)):
                self._mm_counted.discard((request.request_id, i))

    def take_freed_hashes(self) -> list[str]:
        return self.cache.get_freed_mm_hashes()

    def make_stats(self) -> MultiModalStats | None:
        stats = msgspec.structs.replace(self.mm_stats)
        stats.processor_cache_queries = self.processor_cache.queries
        stats.processor_cache_hits = self.processor_cache.hits
        return stats

    def record(self, output: ModelRunnerOutput) -> None:
        runs = output.encoder_stats
        if runs is not None:
            self.mm_stats.vision_tower_runs += runs.vision_tower_runs
            self.mm_stats.ec_connector_loads += runs.ec_connector_loads
            self.mm_stats.ec_connector_saves += runs.ec_connector_saves

    def request_census(self) -> dict[str, int]:
        return {"counted_queries": len(self._mm_counted), **self.cache.request_census()}

    def check_integrity(self) -> None:
        self.cache.check_integrity()


class CrossAttentionEncoderPlanner(EncoderPlanner):
    """An encoder-decoder model's (Whisper): the request's encoder input is needed once,
    by its first chunk (the step whose cross-attention layers write the encoder's K/V
    into the request's cross-attention blocks), and never again after it; the decoder's
    token positions do not hold the item. Two requests with the same input share one
    encoder output (the encoder cache, by content hash)."""

    def check_request(self, request: Request) -> None:
        for i, feature in enumerate(request.mm_features):
            length = feature.mm_position.length
            if length > self.max_num_encoder_input_tokens:
                raise ValueError(
                    f"encoder input {i} has {length} positions, more than the encoder cache "
                    f"({self.max_num_encoder_input_tokens})"
                )

    def try_schedule(
        self, request: Request, num_computed: int, num_new: int, encoder_budget: int
    ) -> tuple[list[int], int, int]:
        if not request.mm_features or num_new <= 0 or num_computed > 0:
            return [], num_new, encoder_budget
        manager = self.cache
        to_schedule: list[int] = []
        num_embeds = 0
        for i, feature in enumerate(request.mm_features):
            if manager.check_and_update_cache(request, i):
                self._count_query(request, i, hit=True)
                continue
            length = feature.mm_position.length
            if not manager.can_allocate(request, i, encoder_budget, num_embeds):
                return [], 0, encoder_budget  # the whole first chunk waits for the encoder
            self._count_query(request, i, hit=False)
            num_embeds += length
            encoder_budget -= length
            to_schedule.append(i)
        return to_schedule, num_new, encoder_budget

    def free_computed(self, request: Request) -> None:
        """After the first chunk the K/V are in the cross-attention blocks."""
        if request.mm_features and request.num_computed_tokens > 0:
            self.cache.free(request)
