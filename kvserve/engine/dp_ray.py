"""The Ray data-parallel backend (``--data-parallel-backend ray``): every rank's engine
core runs in a Ray actor, the actors spread over the cluster's nodes by one placement
group (one bundle per rank, SPREAD: a rank per node while nodes last). Each actor's core
connects back to the front end's handshake server like a headless node's core
(engine_core/remote_core.py), so requests and outputs travel over the same ZMQ/msgpack
sockets as the mp cores' and Ray carries only the actor's creation and its one ``run``
call (the config, as a spawned core gets it).

Which cluster: the one this process joined (``ray.init`` by the caller, e.g. a test's
``ray.cluster_utils.Cluster``), else ``RAY_ADDRESS`` (``ray start --head`` on the head
node; ``auto`` finds a local one), else a fresh local Ray instance, as the Ray executor.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from typing import TYPE_CHECKING, Any

from kvserve.engine.dp_remote import DPHandshakeServer

if TYPE_CHECKING:
    from kvserve.config import EngineConfig

logger = logging.getLogger(__name__)


def init_ray() -> bool:
    """Joins a cluster (see the module doc); True if this call started Ray."""
    import ray

    if ray.is_initialized():
        return False
    ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False)
    return True


def node_address() -> str:
    import ray

    return str(ray.util.get_node_ip_address())


class RayCoreActors:
    """The actors of every rank, started against ``server``'s address; their ``run``
    calls are watched, so an actor that dies (or never connects) ends its rank."""

    def __init__(self, configs: list[EngineConfig], server: DPHandshakeServer, owns_ray: bool):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        # The actor class lives with the core (torch) code; only the actor's process
        # imports it past its name (.importlinter names this edge).
        from kvserve.engine_core.remote_core import RayEngineCoreActor

        self._owns_ray = owns_ray
        self._closed = False
        size = len(configs)
        self.placement_group = placement_group([{"CPU": 1.0}] * size, strategy="SPREAD")
        ray.get(self.placement_group.ready(), timeout=300)
        actor_cls = ray.remote(num_cpus=1)(RayEngineCoreActor)  # type: ignore[call-overload]
        self.actors: list[Any] = [
            actor_cls.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.placement_group, placement_group_bundle_index=rank
                ),
            ).remote()
            for rank in range(size)
        ]
        self.node_ids: list[str] = ray.get([a.node_id.remote() for a in self.actors])
        level = logging.getLogger("kvserve").getEffectiveLevel()
        self._runs = {
            actor.run.remote(config, server.address, level): rank
            for rank, (actor, config) in enumerate(zip(self.actors, configs, strict=True))
        }
        for rank, actor in enumerate(self.actors):
            server.startups[rank].proc.on_kill = functools.partial(ray.kill, actor)
        self._server = server
        self._watch = threading.Thread(target=self._watch_runs, name="RayDPWatch", daemon=True)
        self._watch.start()
        logger.info("data-parallel cores in %d Ray actors on nodes %s", size, self.node_ids)

    def _watch_runs(self) -> None:
        import ray

        pending = list(self._runs)
        while pending and not self._closed:
            done, pending = ray.wait(pending, num_returns=1, timeout=1.0)
            for ref in done:
                rank = self._runs[ref]
                try:
                    why = f"Ray actor's core exited (code {ray.get(ref)})"
                except Exception as e:  # RayActorError: the actor's process is gone
                    why = f"Ray actor died ({type(e).__name__})"
                self._server.startups[rank].proc.mark_dead(why)

    def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        self._closed = True
        self._watch.join(5)
        for actor in self.actors:
            ray.kill(actor)
        remove_placement_group(self.placement_group)
        if self._owns_ray:
            ray.shutdown()
