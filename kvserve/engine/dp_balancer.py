"""DPLoadBalancer: which data-parallel engine core takes a new request, and which core
owns each request in flight.

Load (vLLM's internal balancing): every core reports its waiting and running counts with
each of its outputs; the balancer adds the requests it sent a core since that report
(which the core may not have seen yet), and scores a core ``4 * waiting + running``, a
queued request costing more than a running one. Among equals it takes the core routed
fewest requests so far, so an idle fleet is served round robin.

Prefix (``data_parallel_load_balance="prefix"``): the cores' KV cache events ride on
their outputs into a PrefixIndex (core/prefix_index.py, the one the prefix router
keeps), so a request goes to the core that holds the longest cached prefix of its prompt
unless that core is overloaded: more than PREFIX_OVERLOAD_SLACK requests ahead of the
least-loaded core, where a hit saves less than the queue costs. LoRA and multimodal
requests hash their blocks with extra keys the index does not know: they match nothing
and go by load.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from kvserve.config import EngineConfig
from kvserve.core.prefix_index import PrefixIndex
from kvserve.protocol.engine_core import EngineCoreOutputs, EngineCoreRequest

# vLLM's weight of a waiting request against a running one in the load score.
WAITING_WEIGHT = 4
# How many requests more than the least-loaded core the prefix core may have in flight
# (waiting or running) before a new request goes by load instead.
PREFIX_OVERLOAD_SLACK = 4


class PrefixPolicy(ABC):
    """Which cores hold a prompt's prefix, learned from their KV cache events."""

    @abstractmethod
    def matched(self, request: EngineCoreRequest, cores: list[int]) -> dict[int, int]:
        """Prompt tokens each core holds as its cached prefix of the request's prompt."""

    @abstractmethod
    def apply(self, core: int, outputs: EngineCoreOutputs) -> None: ...

    @abstractmethod
    def forget(self, core: int) -> None: ...


class NoPrefixPolicy(PrefixPolicy):
    """least_loaded: no core is preferred for its cache."""

    def matched(self, request: EngineCoreRequest, cores: list[int]) -> dict[int, int]:
        return {}

    def apply(self, core: int, outputs: EngineCoreOutputs) -> None:
        return None

    def forget(self, core: int) -> None:
        return None


class IndexPrefixPolicy(PrefixPolicy):
    def __init__(self, block_size: int, hash_seed: int) -> None:
        self.index = PrefixIndex(block_size, hash_seed)

    def matched(self, request: EngineCoreRequest, cores: list[int]) -> dict[int, int]:
        if request.lora_request is not None or request.mm_features:
            return {}
        by_name = self.index.match(request.prompt_token_ids, request.cache_salt)
        return {core: by_name.get(str(core), 0) for core in cores}

    def apply(self, core: int, outputs: EngineCoreOutputs) -> None:
        if outputs.kv_events:
            self.index.apply(str(core), outputs.kv_events)

    def forget(self, core: int) -> None:
        self.index.forget(str(core))


class DPLoadBalancer:
    """Chooses cores for new requests and remembers each request's core (for its aborts
    and, when a core dies, its failure). One writer: the front end's client."""

    def __init__(self, size: int, policy: PrefixPolicy) -> None:
        self.policy = policy
        self.alive = list(range(size))
        self._waiting = [0] * size
        self._running = [0] * size
        # Requests sent since the core's last report: counted as waiting until it reports.
        self._unreported = [0] * size
        self.routed = [0] * size
        self.owner: dict[str, int] = {}

    @classmethod
    def from_config(cls, config: EngineConfig) -> DPLoadBalancer:
        parallel = config.parallel_config
        cache = config.cache_config
        prefix = parallel.data_parallel_load_balance == "prefix" and cache.enable_prefix_caching
        return cls(
            parallel.data_parallel_size,
            IndexPrefixPolicy(cache.block_size, cache.prefix_caching_hash_seed)
            if prefix
            else NoPrefixPolicy(),
        )

    def _score(self, core: int) -> int:
        return WAITING_WEIGHT * (self._waiting[core] + self._unreported[core]) + self._running[core]

    def _in_flight(self, core: int) -> int:
        return self._waiting[core] + self._unreported[core] + self._running[core]

    def choose(self, request: EngineCoreRequest) -> int:
        """The core for a new request (and its n > 1 siblings)."""
        if not self.alive:
            raise RuntimeError("no engine core is alive")
        least = min(self.alive, key=lambda c: (self._score(c), self.routed[c], c))
        matched = self.policy.matched(request, self.alive)
        if matched:
            best = min(self.alive, key=lambda c: (-matched[c], self._score(c), self.routed[c], c))
            overloaded = self._in_flight(best) > self._in_flight(least) + PREFIX_OVERLOAD_SLACK
            if matched[best] > 0 and not overloaded:
                return best
        return least

    def assign(self, request_ids: list[str], core: int) -> None:
        for request_id in request_ids:
            self.owner[request_id] = core
        self._unreported[core] += len(request_ids)
        self.routed[core] += len(request_ids)

    def on_outputs(self, outputs: EngineCoreOutputs) -> None:
        """A core's outputs: its counts, its KV events, the requests it finished."""
        core = outputs.engine_index
        stats = outputs.scheduler_stats
        if stats is not None:
            self._waiting[core] = stats.num_waiting_reqs
            self._running[core] = stats.num_running_reqs
            self._unreported[core] = 0
        self.policy.apply(core, outputs)
        for output in outputs.outputs:
            if output.finish_reason is not None:
                self.owner.pop(output.request_id, None)
        for request_id in outputs.finished_requests or ():
            self.owner.pop(request_id, None)

    def by_owner(self, request_ids: list[str]) -> dict[int, list[str]]:
        """Aborts: the requests grouped by the core that holds them (forgotten here)."""
        groups: dict[int, list[str]] = {}
        for request_id in request_ids:
            core = self.owner.pop(request_id, None)
            if core is not None:
                groups.setdefault(core, []).append(request_id)
        return groups

    def mark_dead(self, core: int) -> list[str]:
        """The core is gone: it takes no more requests; returns those it held."""
        if core in self.alive:
            self.alive.remove(core)
        self.policy.forget(core)
        lost = [r for r, c in self.owner.items() if c == core]
        for request_id in lost:
            del self.owner[request_id]
        return lost

    def request_census(self) -> dict[str, int]:
        return {"owners": len(self.owner)}
