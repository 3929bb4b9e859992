"""The encoder cache: outputs of a model's encoders (a vision tower's image embeddings),
shared between requests by content hash and freed lazily (vLLM's EncoderCacheManager).

Space is counted in embedding tokens, the unit of both the encoder's compute and the
memory its outputs take. An entry referenced by a running request stays; when its last
reference goes it becomes *freeable* but keeps its data, so a later request with the same
image (same hash) reuses it without running the encoder again. Freeable entries are
evicted oldest first, and only when an allocation needs their space. The worker learns
which outputs to drop from ``get_freed_mm_hashes``.

Invariants (``check_integrity``): free + referenced + freeable space = capacity; the
freeable entries are exactly the unreferenced cached ones; free + freeable space is what
an allocation may take.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from kvserve.protocol.mm_inputs import MultiModalFeatureSpec


class EncoderRequest(Protocol):
    """What the cache reads of a request: its id and its multimodal items in order."""

    @property
    def request_id(self) -> str: ...

    @property
    def mm_features(self) -> Sequence[MultiModalFeatureSpec]: ...


def num_encoder_tokens(request: EncoderRequest, input_id: int) -> int:
    return request.mm_features[input_id].mm_position.length


class EncoderCacheManager:
    def __init__(self, cache_size: int) -> None:
        if cache_size <= 0:
            raise ValueError(f"encoder cache size must be positive, got {cache_size}")
        self.cache_size = cache_size
        self.num_free_slots = cache_size
        # Free plus freeable: what an allocation may take after evicting.
        self.num_freeable_slots = cache_size
        self.cached: dict[str, set[str]] = {}  # mm hash -> ids of requests using it
        self._sizes: dict[str, int] = {}  # mm hash -> embedding tokens
        self.freeable: OrderedDict[str, int] = OrderedDict()  # unreferenced, oldest first
        self.freed: list[str] = []  # evicted since get_freed_mm_hashes last ran

    def check_and_update_cache(self, request: EncoderRequest, input_id: int) -> bool:
        """Whether item ``input_id``'s output is cached; if so the request now holds it."""
        mm_hash = request.mm_features[input_id].identifier
        users = self.cached.get(mm_hash)
        if users is None:
            return False
        if not users:  # freeable until now: in use again
            self.num_freeable_slots -= self.freeable.pop(mm_hash)
        users.add(request.request_id)
        return True

    def can_allocate(
        self,
        request: EncoderRequest,
        input_id: int,
        encoder_compute_budget: int,
        num_embeds_to_schedule: int,
    ) -> bool:
        """Whether item ``input_id`` fits this step's encoder compute budget and the cache
        (beside ``num_embeds_to_schedule`` tokens already taken this step), evicting
        freeable entries, oldest first, only as far as needed."""
        needed = num_encoder_tokens(request, input_id)
        if needed > encoder_compute_budget:
            return False
        needed += num_embeds_to_schedule
        if needed <= self.num_free_slots:
            return True
        if needed > self.num_freeable_slots:
            return False
        while self.num_free_slots < needed:
            mm_hash, size = self.freeable.popitem(last=False)
            del self.cached[mm_hash], self._sizes[mm_hash]
            self.freed.append(mm_hash)
            self.num_free_slots += size
        return True

    def allocate(self, request: EncoderRequest, input_id: int) -> None:
        """Reserves the space of item ``input_id`` (after ``can_allocate`` said it fits)."""
        mm_hash = request.mm_features[input_id].identifier
        size = num_encoder_tokens(request, input_id)
        if mm_hash in self.cached:
            raise ValueError(f"encoder output {mm_hash} is cached already")
        if size > self.num_free_slots:
            raise ValueError(f"{size} encoder tokens do not fit {self.num_free_slots} free slots")
        self.cached[mm_hash] = {request.request_id}
        self._sizes[mm_hash] = size
        self.num_free_slots -= size
        self.num_freeable_slots -= size

    def get_cached_input_ids(self, request: EncoderRequest) -> set[int]:
        return {
            i
            for i, feature in enumerate(request.mm_features)
            if request.request_id in self.cached.get(feature.identifier, ())
        }

    def free_encoder_input(self, request: EncoderRequest, input_id: int) -> None:
        """The request no longer needs item ``input_id`` (its embeddings are in the KV)."""
        mm_hash = request.mm_features[input_id].identifier
        users = self.cached.get(mm_hash)
        if users is None or request.request_id not in users:
            return
        users.discard(request.request_id)
        if not users:
            size = self._sizes[mm_hash]
            self.freeable[mm_hash] = size
            self.num_freeable_slots += size

    def free(self, request: EncoderRequest) -> None:
        """Drops every reference the request holds (finished or preempted)."""
        for input_id in sorted(self.get_cached_input_ids(request)):
            self.free_encoder_input(request, input_id)

    def request_census(self) -> dict[str, int]:
        """Requests still holding an encoder output (cached outputs nobody holds are the
        cache, bounded by cache_size, not per-request state)."""
        return {"users": sum(len(users) for users in self.cached.values())}

    def get_freed_mm_hashes(self) -> list[str]:
        freed, self.freed = self.freed, []
        return freed

    def check_integrity(self) -> None:
        referenced = sum(self._sizes[h] for h, users in self.cached.items() if users)
        freeable = sum(self.freeable.values())
        assert self.num_free_slots + referenced + freeable == self.cache_size
        assert self.num_freeable_slots == self.num_free_slots + freeable
        assert set(self.freeable) == {h for h, users in self.cached.items() if not users}
        assert set(self._sizes) == set(self.cached)
