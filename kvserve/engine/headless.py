"""``kvserve serve MODEL --headless``: a node that runs engine cores only, for a front end
on another node (vLLM's multi-node data parallelism without Ray):

    # node A: the API server and ranks 0..1
    kvserve serve MODEL -dp 4 --data-parallel-size-local 2 \\
        --data-parallel-address A --data-parallel-rpc-port 29550
    # node B: ranks 2..3, no API server
    kvserve serve MODEL --headless -dp 4 --data-parallel-size-local 2 \\
        --data-parallel-start-rank 2 --data-parallel-address A --data-parallel-rpc-port 29550

Each rank is a process like a front end's core (spawned here, its own config built from
this node's flags); it connects to the front end's handshake server and serves until
the front end goes away or stops it (engine_core/remote_core.py). The launcher exits
when its cores have, with the worst of their exit codes.
"""

from __future__ import annotations

import logging
import signal
from multiprocessing.connection import wait
from typing import Any

from kvserve.config import EngineConfig
from kvserve.engine.dp_client import rank_config
from kvserve.utils.processes import spawn, stop

logger = logging.getLogger(__name__)


def handshake_address(config: EngineConfig) -> str:
    parallel = config.parallel_config
    return (
        f"tcp://{parallel.data_parallel_address or '127.0.0.1'}:{parallel.data_parallel_rpc_port}"
    )


def run_headless(config: EngineConfig) -> int:
    parallel = config.parallel_config
    if parallel.data_parallel_backend == "ray":
        raise ValueError(
            "headless: with data_parallel_backend='ray' Ray places every rank; "
            "join this node to the Ray cluster (`ray start`) instead"
        )
    ranks = parallel.local_data_parallel_ranks
    if not ranks:
        raise ValueError("headless: data_parallel_size_local must be at least 1")
    # The core's body; only the spawned processes import past its light module top.
    from kvserve.engine_core.remote_core import headless_core_main

    address = handshake_address(config)
    level = logging.getLogger("kvserve").getEffectiveLevel()
    procs = [
        spawn(headless_core_main, (rank_config(config, r), address, level), f"EngineCore_DP{r}")
        for r in ranks
    ]
    logger.info(
        "headless: data-parallel ranks %d..%d started for the front end at %s",
        ranks.start,
        ranks.stop - 1,
        address,
    )
    stopping = False

    def _on_signal(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _on_signal)
    try:
        waiting = list(procs)
        while waiting and not stopping:
            wait([p.sentinel for p in waiting], timeout=0.5)
            waiting = [p for p in waiting if p.is_alive()]
    finally:
        stop(list(procs), grace_s=5.0)
    codes = [p.exitcode or 0 for p in procs]
    logger.info("headless: engine cores exited with %s", codes)
    return 0 if stopping else max(codes, key=abs)
