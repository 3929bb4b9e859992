"""The parallelism engine arguments (tensor, pipeline and data parallel; vLLM's names),
their CLI flags, and the ParallelConfig they make.

One dataclass of fields, one ``_parallel_config`` that turns them into the config, one
``add_parallel_cli_args`` that declares their flags in one argument group: a new
parallelism option adds a line to each."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Literal

from kvserve.config import ParallelConfig


@dataclass
class ParallelArgs:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: Literal["uni", "mp", "ray"] | None = None
    # Pipeline parallelism: several micro-batches in flight (False: one step at a time).
    batch_queue: bool = True
    data_parallel_size: int = 1
    data_parallel_load_balance: Literal["least_loaded", "prefix"] = "least_loaded"
    data_parallel_tolerate_failure: bool = False
    enable_expert_parallel: bool = False
    # Multi-node data parallelism (vLLM's names; config/runtime.py ParallelConfig).
    data_parallel_backend: Literal["mp", "ray"] = "mp"
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int = 0
    # External load balancing: this server runs only this rank's core.
    data_parallel_rank: int | None = None
    data_parallel_address: str | None = None
    data_parallel_rpc_port: int = 29550
    data_parallel_master_port: int | None = None
    # `kvserve serve --headless`: this node runs its engine cores only (engine/headless.py).
    headless: bool = False
    # Dual batch overlap: steps cut into two micro-batches (worker/ubatch_runner.py).
    enable_dbo: bool = False
    dbo_decode_token_threshold: int = 32
    dbo_prefill_token_threshold: int = 512

    def _parallel_config(self) -> ParallelConfig:
        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            distributed_executor_backend=self.distributed_executor_backend,
            batch_queue=self.batch_queue,
            data_parallel_size=self.data_parallel_size,
            data_parallel_load_balance=self.data_parallel_load_balance,
            data_parallel_tolerate_failure=self.data_parallel_tolerate_failure,
            enable_expert_parallel=self.enable_expert_parallel,
            data_parallel_backend=self.data_parallel_backend,
            data_parallel_size_local=self.data_parallel_size_local,
            data_parallel_start_rank=self.data_parallel_start_rank,
            data_parallel_rank=self.data_parallel_rank or 0,
            data_parallel_external_lb=self.data_parallel_rank is not None,
            data_parallel_address=self.data_parallel_address,
            data_parallel_rpc_port=self.data_parallel_rpc_port,
            data_parallel_master_port=self.data_parallel_master_port,
            enable_dbo=self.enable_dbo,
            dbo_decode_token_threshold=self.dbo_decode_token_threshold,
            dbo_prefill_token_threshold=self.dbo_prefill_token_threshold,
        )


def add_parallel_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("parallelism (docs/distributed.md)")
    group.add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=1,
        help="split each layer across this many worker ranks (docs/distributed.md)",
    )  # fmt: skip
    group.add_argument(
        "--pipeline-parallel-size", "-pp", type=int, default=1,
        help="split the decoder layers into this many stages (Llama; docs/distributed.md)",
    )  # fmt: skip
    group.add_argument(
        "--data-parallel-size", "-dp", type=int, default=1,
        help="run this many engine cores (each with its own scheduler, KV cache and "
        "-tp x -pp workers) behind one front end (docs/distributed.md)",
    )  # fmt: skip
    group.add_argument(
        "--data-parallel-load-balance", default="least_loaded",
        choices=["least_loaded", "prefix"],
        help="with -dp: send a new request to the core with the fewest waiting, then "
        "running requests (least_loaded), or to the core holding the longest cached "
        "prefix of its prompt unless that core is overloaded (prefix)",
    )  # fmt: skip
    group.add_argument(
        "--data-parallel-tolerate-failure", action="store_true",
        help="with -dp: a dead engine core fails only its own requests (503) and the "
        "others keep serving; by default one dead core takes the server down",
    )  # fmt: skip
    group.add_argument(
        "--enable-expert-parallel", action="store_true",
        help="MoE models: shard the experts across the -dp x -tp ranks (each loads only "
        "its own) instead of splitting every expert over -tp; with -dp the cores run "
        "attention on their own requests and step together, an idle core joining each "
        "MoE layer with no tokens (docs/distributed.md#expert-parallelism)",
    )  # fmt: skip
    group.add_argument(
        "--data-parallel-backend", "-dpb", default="mp", choices=["mp", "ray"],
        help="with -dp: engine cores as processes (mp) or as Ray actors across the "
        "cluster's nodes (ray; docs/distributed.md)",
    )  # fmt: skip
    group.add_argument(
        "--data-parallel-size-local", "-dpl", type=int, default=None,
        help="with -dp: how many of the ranks run on this node (default: all; the "
        "others come from --headless nodes)",
    )  # fmt: skip
    group.add_argument(
        "--data-parallel-start-rank", "-dpr", type=int, default=0,
        help="with --headless: this node's first rank",
    )  # fmt: skip
    group.add_argument(
        "--data-parallel-rank", "-dpn", type=int, default=None,
        help="with -dp: external load balancing, this server runs this rank's core only "
        "(one server per rank, balanced by the caller)",
    )  # fmt: skip
    group.add_argument(
        "--data-parallel-address", "-dpa", default=None,
        help="with -dp over several nodes: the front end's address (where the other "
        "nodes' cores connect, and where cores sharing experts meet; default loopback)",
    )  # fmt: skip
    group.add_argument(
        "--data-parallel-rpc-port", "-dpp", type=int, default=29550,
        help="with -dp over several nodes: the front end's handshake port",
    )  # fmt: skip
    group.add_argument(
        "--data-parallel-master-port", type=int, default=None,
        help="with -dp and --enable-expert-parallel: the port of the workers' "
        "torch.distributed world; the cores' step agreement takes the next one "
        "(default: free ports picked at start)",
    )  # fmt: skip
    group.add_argument(
        "--headless", action="store_true",
        help="run this node's engine cores only (no API server), for the front end at "
        "--data-parallel-address",
    )  # fmt: skip
    group.add_argument(
        "--no-batch-queue", dest="batch_queue", action="store_false",
        help="with -pp: run one micro-batch at a time instead of keeping one per stage "
        "in flight (the stages then take turns; for comparison)",
    )  # fmt: skip
    group.add_argument(
        "--enable-dbo", action="store_true",
        help="dual batch overlap: cut a big enough step into two micro-batches whose "
        "forwards take turns at each -tp all-reduce, one's communication overlapping the "
        "other's compute (docs/distributed.md#dual-batch-overlap)",
    )  # fmt: skip
    group.add_argument(
        "--dbo-decode-token-threshold", type=int, default=32,
        help="with --enable-dbo: cut a decode-only step from this many tokens",
    )  # fmt: skip
    group.add_argument(
        "--dbo-prefill-token-threshold", type=int, default=512,
        help="with --enable-dbo: cut a step with a prefill from this many tokens",
    )  # fmt: skip
    group.add_argument(
        "--distributed-executor-backend", default=None, choices=["uni", "mp", "ray"],
        help="uni: one worker in the engine process; mp: a process per rank (the "
        "default for several); ray: a Ray actor per rank, on one node or several",
    )  # fmt: skip
