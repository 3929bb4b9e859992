"""RayDistributedExecutor with TP=2 on the tiny random Llama with one (replicated) KV
head: transformers' greedy tokens on a local Ray instance and on a two-node
``ray.cluster_utils.Cluster`` with one rank per node; a killed actor fails the engine fast."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvserve.executor.abstract import ExecutorFailedError
from kvserve.sampling_params import SamplingParams
from tests.executor.tiny_llama import MAX_TOKENS, PROMPTS, greedy, hf_greedy, tp_llm

ray = pytest.importorskip("ray", reason="the Ray executor needs `pip install ray` (extra: ray)")


def test_tp2_on_a_local_ray_instance_matches_transformers(checkpoints: dict[str, Any]) -> None:
    """No cluster joined: the executor starts a local Ray instance itself."""
    assert not ray.is_initialized()
    path, hf = checkpoints["hf"]
    llm = tp_llm(path, 2, distributed_executor_backend="ray")
    try:
        assert greedy(llm) == [hf_greedy(hf, p) for p in PROMPTS]
        assert ray.is_initialized() and len(ray.nodes()) == 1
    finally:
        llm.llm_engine.shutdown()
    assert not ray.is_initialized()  # the instance it started ended with it


@pytest.fixture(scope="module")
def two_node_cluster() -> Iterator[Any]:
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, include_dashboard=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def node_and_pid(worker: Any) -> tuple[str, int]:
    return ray.get_runtime_context().get_node_id(), os.getpid()


def test_tp2_on_two_ray_nodes_matches_transformers(
    two_node_cluster: Any, checkpoints: dict[str, Any]
) -> None:
    path, hf = checkpoints["hf"]
    llm = tp_llm(path, 2, distributed_executor_backend="ray")
    try:
        assert greedy(llm) == [hf_greedy(hf, p) for p in PROMPTS]
        executor = llm.llm_engine.engine_core.engine_core.model_executor
        placed = executor.collective_rpc("tests.executor.test_ray_executor:node_and_pid")
        nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        assert len(nodes) == 2 and {node for node, _ in placed} == nodes  # one rank each
        os.kill(placed[1][1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(ExecutorFailedError, match=r"worker 1 \(Ray actor\) died"):
            greedy(llm)
        assert time.monotonic() - start < 15
    finally:
        llm.llm_engine.shutdown()


def test_tiered_kv_cache_on_two_ray_nodes(
    two_node_cluster: Any, checkpoints: dict[str, Any]
) -> None:
    """Each rank's lookup service listens on TCP at its node's address, announced to the
    engine core through the connector handshake; a prefix the prefix cache forgot comes
    back from every rank's CPU tier with transformers' tokens."""
    path, hf = checkpoints["hf"]
    tiered = {
        "kv_connector": "TieredCacheConnector",
        "kv_connector_extra_config": {"chunk_size": 4},
    }
    llm = tp_llm(path, 2, distributed_executor_backend="ray", kv_transfer_config=tiered)
    try:
        expected = [hf_greedy(hf, p) for p in PROMPTS]
        assert greedy(llm) == expected
        connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
        assert all(a.startswith("tcp://") for a in connector._lookup_client.addresses)
        llm.reset_prefix_cache()
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == expected
        # Whole chunks of 4 short of the last token: 4, 8 and 0 of 6, 9 and 1 tokens.
        assert [o.num_cached_tokens for o in outs] == [4, 8, 0]
    finally:
        llm.llm_engine.shutdown()


def test_pp2_stages_on_two_ray_nodes_keep_two_micro_batches_in_flight(
    two_node_cluster: Any, checkpoints: dict[str, Any]
) -> None:
    """One pipeline stage per node, the intermediate tensors crossing between them; the
    batch queue (on by default) keeps both stages busy."""
    path, hf = checkpoints["hf"]
    llm = tp_llm(path, 1, pipeline_parallel_size=2, distributed_executor_backend="ray")
    try:
        assert greedy(llm) == [hf_greedy(hf, p) for p in PROMPTS]
        core = llm.llm_engine.engine_core.engine_core
        assert core.max_batches_in_flight == 2
        executor = core.model_executor
        assert executor.collective_rpc("tests.executor.rpc_functions:own_layers") == [[0], [1]]
        placed = executor.collective_rpc("tests.executor.test_ray_executor:node_and_pid")
        assert len({node for node, _ in placed}) == 2
    finally:
        llm.llm_engine.shutdown()
