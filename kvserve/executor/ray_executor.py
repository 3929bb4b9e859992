"""RayDistributedExecutor: one worker per rank as a Ray actor, placed by a placement group,
on one machine or several.

Ray places the actors (one CPU bundle per rank) and carries the calls; the ranks join
torch.distributed themselves at rank 0's node address, as under MultiprocExecutor. Every
call and reply is the executor wire format (serial_utils: msgspec bytes), so Ray moves
opaque bytes and unpickles nothing of kvserve's; the config reaches each actor once, at
creation, as the multiprocess workers get theirs from spawn.

Which cluster: the one this process already joined (``ray.init`` by the caller, e.g. a
test's ``ray.cluster_utils.Cluster``), else ``RAY_ADDRESS`` (an existing cluster started
with ``ray start --head``; ``auto`` finds a local one), else a fresh local Ray instance.

A lost actor is noticed at once, idle or not: each actor runs a ``watch`` call that
never returns, in its own concurrency group; when the actor dies that call fails, and the
executor fails every pending and later call with ExecutorFailedError.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from concurrent.futures import Future
from typing import Any

import msgspec

from kvserve.config import EngineConfig
from kvserve.executor import serial_utils as wire
from kvserve.executor.multiproc_executor import MultiprocExecutor
from kvserve.executor.multiproc_worker import call_worker
from kvserve.utils.processes import startup_error
from kvserve.utils.threads import usable_cores

logger = logging.getLogger(__name__)


class RayWorkerActor:
    """The body of one rank's actor (wrapped by ray.remote when the executor starts)."""

    def __init__(self, config: EngineConfig, rank: int, num_threads: int) -> None:
        import torch

        torch.set_num_threads(num_threads)
        self.config = config
        self.rank = rank
        self._stop = threading.Event()
        self.worker: Any = None

    def address(self) -> str:
        """A tcp:// rendezvous on this actor's node (used of rank 0's)."""
        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((host, 0))
            return f"tcp://{host}:{s.getsockname()[1]}"

    def start(self, distributed_init_method: str) -> bytes:
        from kvserve.worker.worker import Worker

        try:
            self.worker = Worker(self.config, self.rank, 0, distributed_init_method)
            self.worker.init_device()
            self.worker.load_model()
        except Exception as e:
            logger.exception("ray worker %d failed to start", self.rank)
            return wire.encode(wire.ReadyMessage(self.rank, type(e).__name__, str(e)))
        return wire.encode(wire.ReadyMessage(self.rank))

    def call(self, frame: bytes) -> bytes:
        request = msgspec.msgpack.decode(frame, type=wire.RPCRequest)
        return wire.encode(call_worker(self.worker, self.rank, request))

    def watch(self) -> None:
        self._stop.wait()

    def stop(self) -> None:
        self._stop.set()
        if self.worker is not None:
            self.worker.shutdown()


class RayDistributedExecutor(MultiprocExecutor):
    """Reuses MultiprocExecutor's call bookkeeping (futures, replies by rank, failure);
    only the transport differs."""

    def _init_executor(self) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.world_size = self.config.parallel_config.world_size
        self._init_call_state()
        self._closed = False
        self.actors: list[Any] = []
        # A Ray instance this executor started ends with it; a joined cluster stays up.
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False)
        bundles = [{"CPU": 1.0} for _ in range(self.world_size)]
        self.placement_group = placement_group(bundles, strategy="PACK")
        ray.get(self.placement_group.ready(), timeout=300)
        # This core's share of the cores (data parallelism: several cores share them).
        share = usable_cores() // self.config.parallel_config.data_parallel_size
        threads = max(1, share // self.world_size)
        # Ray's stubs type remote() for functions; actors also take concurrency groups.
        actor_cls = ray.remote(  # type: ignore[call-overload]
            num_cpus=1, concurrency_groups={"watch": 1, "calls": 1}
        )(RayWorkerActor)
        self.actors = [
            actor_cls.options(  # type: ignore[attr-defined]
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.placement_group, placement_group_bundle_index=rank
                ),
            ).remote(self.config, rank, threads)
            for rank in range(self.world_size)
        ]
        init_method = ray.get(self.actors[0].address.options(concurrency_group="calls").remote())
        ready = ray.get(
            [a.start.options(concurrency_group="calls").remote(init_method) for a in self.actors]
        )
        for data in ready:
            message = wire.decode(data, wire.ReadyMessage)
            if message.error is not None:
                self.shutdown()
                raise startup_error(message.error_type, f"worker {message.rank}: {message.error}")
        self._watches = {
            a.watch.options(concurrency_group="watch").remote(): rank
            for rank, a in enumerate(self.actors)
        }
        self._monitor = threading.Thread(target=self._watch_actors, name="RayWatch", daemon=True)
        self._monitor.start()
        logger.info(
            "RayDistributedExecutor: %d actors ready (%d threads each)", self.world_size, threads
        )

    def _watch_actors(self) -> None:
        import ray

        refs = list(self._watches)
        done, _ = ray.wait(refs, num_returns=1)
        if self._closed:
            return
        rank = self._watches[done[0]]
        try:
            ray.get(done[0])
            reason = "stopped"
        except Exception as e:  # RayActorError: the actor's process is gone
            reason = f"died ({type(e).__name__})"
        self._fail(f"worker {rank} (Ray actor) {reason}")

    def _is_closed(self) -> bool:
        return self._closed

    def _kill_workers(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)

    def _send(self, frame: bytes) -> None:
        for actor in self.actors:
            ref = actor.call.options(concurrency_group="calls").remote(frame)
            ref.future().add_done_callback(self._on_ref_done)

    def _on_ref_done(self, future: Future[bytes]) -> None:
        error = future.exception()
        if error is not None:
            return  # the watch call reports the lost actor
        self._on_reply(msgspec.msgpack.decode(future.result(), type=wire.RPCReply))

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if getattr(self, "_closed", True):
            return
        self._closed = True
        if self.failure is None:
            try:
                ray.get(
                    [a.stop.options(concurrency_group="calls").remote() for a in self.actors],
                    timeout=30,
                )
            except Exception:
                logger.warning("ray workers did not stop cleanly", exc_info=True)
        self._kill_workers()
        if getattr(self, "placement_group", None) is not None:
            remove_placement_group(self.placement_group)
        for fd in self._failure_pipe:
            os.close(fd)
        if self._owns_ray:
            ray.shutdown()
