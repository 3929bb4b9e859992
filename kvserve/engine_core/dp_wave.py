"""Lockstep steps of data-parallel cores that share MoE layers (vLLM's DP "wave").

With expert parallelism across data-parallel cores, every MoE layer is a collective
over all the cores' workers (model_executor/layers/expert_parallel.py): a core that
skipped a step while another ran one would leave that one waiting forever. So the cores
step together: before each step they agree, by a one-int all-reduce over the cores' own
gloo group, whether any of them has work; if one has, every core steps, and a core
whose step ran no forward (no requests, or nothing it could schedule) runs a dummy one,
joining each MoE layer with no tokens. When none has work they all wait, polling their
sockets, and agree again every IDLE_POLL_MS.

The cores' group is a gloo process group of its own (not torch.distributed's default
one, which a core's in-process worker joins with the other cores' workers), on a TCP
store at data_parallel_address:data_parallel_wave_port that core 0 hosts.

``DPWave`` is the no-op form (one core, or no expert parallelism): a core steps when it
has work and blocks on its sockets when it has none.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from kvserve.config import ParallelConfig
from kvserve.distributed.parallel_state import COLLECTIVE_TIMEOUT_S

if TYPE_CHECKING:
    from kvserve.engine_core.core import EngineCore

logger = logging.getLogger(__name__)

# How often idle cores agree again whether one of them got work: the longest a new
# request waits for the other cores to join its first step.
IDLE_POLL_MS = int(os.environ.get("KVSERVE_DP_WAVE_IDLE_POLL_MS", "10"))


class DPWave:
    """One core on its own: it steps when it has work."""

    # Whether the core steps together with others (a signal must not stop it mid-step).
    lockstep = False

    def poll_timeout_ms(self, has_work: bool) -> int | None:
        """How long the loop may wait on its sockets (None: until a message comes)."""
        return 0 if has_work else None

    def any_has_work(self, has_work: bool) -> bool:
        """Whether this turn of the loop steps."""
        return has_work

    def finish_step(self, engine_core: EngineCore, ran_forward: bool) -> None:
        """After this turn's step (or none, on a core without work)."""

    def shutdown(self) -> None:
        pass


class ExpertParallelWave(DPWave):
    """Data-parallel cores that share MoE layers: they step together."""

    lockstep = True

    def __init__(self, parallel: ParallelConfig) -> None:
        port = parallel.data_parallel_wave_port
        if port is None:
            raise ValueError("data_parallel_wave_port must be set (the front end picks one)")
        timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        self.rank = parallel.data_parallel_rank
        self.size = parallel.data_parallel_size
        store = dist.TCPStore(
            parallel.data_parallel_address or "127.0.0.1",
            port,
            self.size,
            is_master=self.rank == 0,
            timeout=timeout,
        )
        self.group = dist.ProcessGroupGloo(
            dist.PrefixStore("dp_wave", store), self.rank, self.size, timeout
        )
        self._store = store  # the group reads it while the cores connect
        self._flag = torch.zeros(1, dtype=torch.int64)
        self.num_dummy_steps = 0
        logger.info(
            "data-parallel rank %d of %d: steps in lockstep with the others (expert parallel)",
            self.rank,
            self.size,
        )

    def poll_timeout_ms(self, has_work: bool) -> int | None:
        return 0 if has_work else IDLE_POLL_MS

    def any_has_work(self, has_work: bool) -> bool:
        self._flag.fill_(int(has_work))
        try:
            # The binding has it; torch's stubs do not (the group is not the default one).
            self.group.allreduce([self._flag]).wait()  # type: ignore[attr-defined]
        except RuntimeError as e:  # gloo: a peer closed its connection
            message = f"data-parallel rank {self.rank}: a peer core left: {e}"
            raise PeerCoreExitedError(message) from None
        return bool(self._flag.item())

    def finish_step(self, engine_core: EngineCore, ran_forward: bool) -> None:
        if not ran_forward:
            try:
                engine_core.model_executor.collective_rpc("execute_dummy_batch")
            except RuntimeError as e:  # gloo, in a MoE layer: a peer is gone
                message = f"data-parallel rank {self.rank}: a peer core left mid-step: {e}"
                raise PeerCoreExitedError(message) from None
            self.num_dummy_steps += 1

    def shutdown(self) -> None:
        logger.info("data-parallel rank %d ran %d dummy step(s)", self.rank, self.num_dummy_steps)


class PeerCoreExitedError(RuntimeError):
    """Another core of the wave is gone (shut down, or dead): this one cannot step
    without it. The front end, which watches every core, reports which one died."""


def make_dp_wave(parallel: ParallelConfig) -> DPWave:
    if parallel.expert_parallel_across_dp:
        return ExpertParallelWave(parallel)
    return DPWave()
