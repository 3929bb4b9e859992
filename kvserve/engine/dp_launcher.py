"""Where each data-parallel rank's engine core comes from, for the front end: a process
it spawns (the ranks of ``--data-parallel-size-local``, mp backend), a core on a
``--headless`` node (the other ranks), or a Ray actor (ray backend: every rank). The
last two reach the front end through its handshake server (dp_remote.py)."""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvserve.engine.core_launcher import CoreStartupHandle, claim_engine_core
from kvserve.engine.dp_remote import DPHandshakeServer
from kvserve.utils.processes import free_port

if TYPE_CHECKING:
    from kvserve.config import EngineConfig
    from kvserve.engine.dp_ray import RayCoreActors

logger = logging.getLogger(__name__)


class DPCoreLauncher:
    """Built before the clients; closed after they shut their cores down."""

    def __init__(
        self, config: EngineConfig, rank_config: Callable[[EngineConfig, int], EngineConfig]
    ) -> None:
        config = with_meeting_ports(config)
        parallel = config.parallel_config
        size = parallel.data_parallel_size
        local = parallel.local_data_parallel_ranks
        if local and local.start != 0:
            raise ValueError(
                "data_parallel_start_rank: the front end runs ranks from 0 "
                "(--headless nodes take the others)"
            )
        self.local = local
        remote = [r for r in range(size) if r not in local]
        self.server: DPHandshakeServer | None = None
        self.ray: RayCoreActors | None = None
        self.config = config
        if not remote:
            return
        ray_backend = parallel.data_parallel_backend == "ray"
        owns_ray = False
        host = parallel.data_parallel_address
        if ray_backend:
            from kvserve.engine import dp_ray

            owns_ray = dp_ray.init_ray()
            host = host or dp_ray.node_address()
        host = host or "127.0.0.1"
        if host != parallel.data_parallel_address:
            self.config = with_address(config, host)
        try:
            self.server = DPHandshakeServer(host, parallel.data_parallel_rpc_port, remote)
            if ray_backend:
                from kvserve.engine.dp_ray import RayCoreActors

                configs = [rank_config(self.config, rank) for rank in range(size)]
                self.ray = RayCoreActors(configs, self.server, owns_ray)
        except BaseException:
            self.close()
            raise

    def startup(self, rank: int) -> CoreStartupHandle:
        if rank in self.local:
            return claim_engine_core()
        assert self.server is not None
        if self.ray is None:
            logger.info("waiting for data-parallel rank %d from a --headless node", rank)
        return self.server.startups[rank]

    def close(self) -> None:
        if self.ray is not None:
            self.ray.close()
            self.ray = None
        if self.server is not None:
            self.server.close()
            self.server = None


def with_address(config: EngineConfig, host: str) -> EngineConfig:
    """``config`` with the front end's resolved address (its clients bind there)."""
    resolved = copy.copy(config)
    resolved.parallel_config = dataclasses.replace(
        config.parallel_config, data_parallel_address=host
    )
    return resolved


def with_meeting_ports(config: EngineConfig) -> EngineConfig:
    """With expert parallelism across the cores, the ports their workers' world and the
    cores' step agreement meet on (ParallelConfig.data_parallel_master_port and
    data_parallel_wave_port): the given master port and the next one, or free ones."""
    parallel = config.parallel_config
    if not parallel.expert_parallel_across_dp:
        return config
    master_port = parallel.data_parallel_master_port
    wave_port = parallel.data_parallel_wave_port
    if wave_port is None:
        wave_port = master_port + 1 if master_port is not None else free_port()
    if master_port is None:
        master_port = free_port()
    met = copy.copy(config)
    met.parallel_config = dataclasses.replace(
        parallel, data_parallel_master_port=master_port, data_parallel_wave_port=wave_port
    )
    return met
