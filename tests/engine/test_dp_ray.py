"""``--data-parallel-backend ray``: each data-parallel rank's engine core in a Ray actor,
on a two-node ``ray.cluster_utils.Cluster`` (one CPU and a custom resource per node, so
one rank per node): transformers' greedy tokens (those of one core), both cores served
requests (their own metrics, by engine label), each on its own node; the front end
talks to them over TCP ZMQ (msgpack), as to a headless node's cores. A killed actor
process ends the engine with a clear error within seconds."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvserve.engine.exceptions import EngineDeadError
from kvserve.entrypoints.llm import LLM
from kvserve.metrics.reader import Counter
from kvserve.sampling_params import SamplingParams
from kvserve.utils.processes import free_port
from tests.family_models import build_family_model, hf_greedy

ray = pytest.importorskip("ray", reason="the Ray backend needs `pip install ray` (extra: ray)")

MAX_TOKENS = 6
PROMPTS = [[5, 17, 42, 9, 88], [3, 4, 5, 6], [100, 7, 21, 33, 2, 11, 9], [60, 61, 62]]


@pytest.fixture(scope="module")
def two_node_cluster() -> Iterator[Any]:
    from ray.cluster_utils import Cluster

    # The head runs the driver only; each of the two nodes has room for one rank.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for i in range(2):
        cluster.add_node(num_cpus=1, resources={f"dp_node_{i}": 1})
    ray.init(address=cluster.address, include_dashboard=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_dp2_on_two_ray_nodes_matches_transformers(two_node_cluster: Any, tmp_path: Path) -> None:
    reference = build_family_model("qwen3", tmp_path)
    llm = LLM(
        str(tmp_path),
        data_parallel_size=2,
        data_parallel_backend="ray",
        data_parallel_rpc_port=free_port(),
        skip_tokenizer_init=True,
        block_size=4,
        kv_cache_memory=8 << 20,
        disable_log_stats=False,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        assert tokens == [hf_greedy(reference, p, MAX_TOKENS) for p in PROMPTS]
        served: dict[str, float] = {}
        for metric in llm.get_metrics():
            if metric.name == "kvserve:request_success" and isinstance(metric, Counter):
                engine = metric.labels["engine"]
                served[engine] = served.get(engine, 0) + metric.value
        assert served.get("0", 0) > 0 and served.get("1", 0) > 0, served
        # One rank per worker node (the head has no CPU for one).
        actors = llm.llm_engine.engine_core.launcher.ray
        workers = [
            n["NodeID"]
            for n in ray.nodes()
            if n["Alive"] and any(r.startswith("dp_node_") for r in n["Resources"])
        ]
        assert len(workers) == 2 and sorted(actors.node_ids) == sorted(workers)
        # A rank's actor process killed: its lost connection ends the engine within seconds.
        core = llm.llm_engine.engine_core.cores[1]
        assert core.proc.pid is not None  # from its hello
        os.kill(core.proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(EngineDeadError, match="died"):
            llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        assert time.monotonic() - killed_at < 15
    finally:
        llm.llm_engine.shutdown()
