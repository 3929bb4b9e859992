"""MultiprocExecutor with tensor parallelism on a tiny random Llama that has fewer KV heads
than ranks (its one KV head is replicated on both): greedy tokens equal transformers', in
float32 (safetensors) and on the GGUF file's own Q8_0 blocks (each rank holding its
block shard); collective_rpc across processes; a killed worker fails the engine fast."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from kvserve.entrypoints.llm import LLM
from kvserve.executor.abstract import ExecutorFailedError
from kvserve.executor.multiproc_executor import MultiprocExecutor
from kvserve.sampling_params import SamplingParams
from tests.executor import rpc_functions
from tests.executor.tiny_llama import MAX_TOKENS, PROMPTS, greedy, hf_greedy, tp_llm
from tests.reference import assert_no_leak


@pytest.fixture(scope="module")
def tp2(checkpoints: dict[str, Any]) -> Iterator[LLM]:
    llm = tp_llm(checkpoints["hf"][0], 2)
    yield llm
    llm.llm_engine.shutdown()


def _executor(llm: LLM) -> MultiprocExecutor:
    executor = llm.llm_engine.engine_core.engine_core.model_executor  # type: ignore[attr-defined]
    assert isinstance(executor, MultiprocExecutor)
    return executor


def test_tp2_float32_matches_transformers(tp2: LLM, checkpoints: dict[str, Any]) -> None:
    hf = checkpoints["hf"][1]
    assert greedy(tp2) == [hf_greedy(hf, p) for p in PROMPTS]
    assert_no_leak(tp2)


def test_tp2_gguf_blocks_match_tp1_and_transformers(checkpoints: dict[str, Any]) -> None:
    path, reference = checkpoints["gguf"]
    expected = [hf_greedy(reference, p) for p in PROMPTS]
    tp1 = tp_llm(path, 1, quantization="gguf")
    try:
        assert greedy(tp1) == expected
    finally:
        tp1.llm_engine.shutdown()
    llm = tp_llm(path, 2, quantization="gguf")
    try:
        assert greedy(llm) == expected
        # Every projection runs on its rank's shard of the file's blocks (none fell back
        # to float32), and each rank's attention holds 2 query heads and the 1 KV head.
        shapes = _executor(llm).collective_rpc("tests.executor.rpc_functions:block_shapes")
    finally:
        llm.llm_engine.shutdown()
    for rank_shapes in shapes:
        assert rank_shapes == {
            "qkv_proj": [[2 * 16 + 16 + 16, 64], "Q8_0"],
            "o_proj": [[64, 32], "Q8_0"],
            "gate_up_proj": [[128, 64], "Q8_0"],
            "down_proj": [[64, 64], "Q8_0"],
            "lm_head": [[128, 64], "Q8_0"],
            "heads": [2, 1],
        }


def test_tp2_tied_gguf_head_serves_the_embedding_lookups(checkpoints: dict[str, Any]) -> None:
    """A tied LM head on 2 ranks (255 tokens: rank 1's last row is padding): each rank's
    embedding looks its rows up in its shard of the head's blocks, with no float32 table,
    and the all-reduced rows are the file's values bit for bit; tokens equal HF's."""
    path, reference = checkpoints["gguf_tied"]
    llm = tp_llm(path, 2, quantization="gguf")
    token_ids = [0, 1, 127, 128, 200, 254, 128, 5]
    try:
        assert greedy(llm) == [hf_greedy(reference, p) for p in PROMPTS]
        ranks = _executor(llm).collective_rpc(
            "tests.executor.rpc_functions:embedding_lookup", args=(token_ids,)
        )
    finally:
        llm.llm_engine.shutdown()
    expected = reference.get_input_embeddings().weight[token_ids].tolist()
    for rank in ranks:
        assert rank["head_blocks"] and rank["weight_numel"] == 0
        assert rank["blocks_shape"] == [128, 64]
        assert rank["rows"] == expected


def test_collective_rpc_across_processes(tp2: LLM) -> None:
    executor = _executor(tp2)
    pids = [p.pid for p in executor.resources.procs]
    # A worker method by name, a function by its module:function path and by object.
    assert executor.collective_rpc("check_health") == [None, None]
    assert executor.collective_rpc("tests.executor.rpc_functions:whoami") == [
        (0, 2, pids[0]),
        (1, 2, pids[1]),
    ]
    assert executor.collective_rpc(rpc_functions.scaled, args=([1, 2],), kwargs={"scale": 0.5}) == [
        [0.5, 1.0],
        [1.5, 2.0],
    ]
    assert executor.collective_rpc(rpc_functions.whoami, unique_reply_rank=1) == [(1, 2, pids[1])]
    # Non-blocking: a future, answered while this thread goes on.
    future = executor.collective_rpc(rpc_functions.nap, args=(0.3,), non_block=True)
    assert not future.done()
    assert future.result(timeout=30) == [0, 1]
    # A timeout fires while the workers are still busy; they answer later calls after.
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="nap"):
        executor.collective_rpc(rpc_functions.nap, args=(2.0,), timeout=0.3)
    assert time.monotonic() - start < 1.5
    assert executor.collective_rpc("check_health", timeout=30) == [None, None]
    with pytest.raises(ValueError, match="importable"):
        executor.collective_rpc(lambda worker: worker.rank)
    with pytest.raises(AttributeError, match="no method 'no_such_method'"):
        executor.collective_rpc("no_such_method", timeout=30)
    # Arguments are decoded against the function's annotations: a wrong type is an error
    # naming the rank and the call, not a surprise inside it.
    with pytest.raises(RuntimeError, match=r"worker \d: .*scaled failed: ValidationError"):
        executor.collective_rpc(rpc_functions.scaled, args=(["x"],), timeout=30)
    # The engine still serves.
    assert len(greedy(tp2)) == len(PROMPTS)


def test_every_frame_between_the_processes_is_msgpack(tp2: LLM) -> None:
    """Frames on the executor's real sockets during a generation and RPCs, recorded as
    they pass: each one decodes as plain msgpack (no pickle anywhere)."""
    executor = _executor(tp2)
    frames: list[bytes] = []
    originals = [sock.send for sock in executor.request_sockets]
    reply_recv = executor.reply_socket.recv

    def recording_send(send: Any) -> Any:
        def record(data: Any, *args: Any, **kwargs: Any) -> Any:
            frames.append(bytes(data))
            return send(data, *args, **kwargs)

        return record

    def recording_recv(*args: Any, **kwargs: Any) -> Any:
        frame = reply_recv(*args, **kwargs)
        frames.append(bytes(frame.buffer) if hasattr(frame, "buffer") else bytes(frame))
        return frame

    for sock, send in zip(executor.request_sockets, originals, strict=True):
        sock.send = recording_send(send)  # type: ignore[method-assign]
    executor.reply_socket.recv = recording_recv  # type: ignore[method-assign]
    try:
        greedy(tp2)
        executor.collective_rpc(rpc_functions.whoami)
    finally:
        for sock, send in zip(executor.request_sockets, originals, strict=True):
            sock.send = send  # type: ignore[method-assign]
        executor.reply_socket.recv = reply_recv  # type: ignore[method-assign]
    assert len(frames) > 2 * MAX_TOKENS
    for frame in frames:
        assert not frame.startswith(b"\x80"), "a pickle protocol header"
        msgspec.msgpack.decode(frame)  # raises unless the frame is msgpack


def test_killed_worker_fails_the_engine_fast(checkpoints: dict[str, Any]) -> None:
    llm = tp_llm(checkpoints["hf"][0], 2)
    try:
        victim = _executor(llm).resources.procs[1]
        os.kill(victim.pid or 0, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(
            ExecutorFailedError, match=r"worker 1 \(pid \d+\) died with exit code -9"
        ):
            greedy(llm)
        assert time.monotonic() - start < 10
    finally:
        llm.llm_engine.shutdown()
    assert not any(p.is_alive() for p in _executor(llm).resources.procs)


def test_a_tp_size_the_model_cannot_split_is_a_clear_error(checkpoints: dict[str, Any]) -> None:
    start = time.monotonic()
    with pytest.raises(
        ValueError, match="tensor_parallel_size=3 does not divide num_attention_heads=4"
    ):
        tp_llm(checkpoints["hf"][0], 3)
    assert time.monotonic() - start < 120


@pytest.mark.parametrize(
    ("kind", "tp", "pp"), [("hf", 1, 2), ("gguf", 2, 2)], ids=["pp2-float32", "tp2xpp2-gguf"]
)
def test_pipeline_stages_match_transformers(
    checkpoints: dict[str, Any], kind: str, tp: int, pp: int
) -> None:
    """Each stage runs one of the two layers (and holds its KV cache only); the hidden
    states and residual cross between stages, the last stage samples. The batch queue
    (on by default) keeps two micro-batches in flight, and a request aborted while its
    micro-batch is in flight leaves the others' tokens, the scheduler and the KV cache
    intact."""
    path, reference = checkpoints[kind]
    quantization = {"quantization": "gguf"} if kind == "gguf" else {}
    llm = tp_llm(path, tp, pipeline_parallel_size=pp, **quantization)
    expected = [hf_greedy(reference, p) for p in PROMPTS]
    try:
        assert greedy(llm) == expected
        layers = _executor(llm).collective_rpc("tests.executor.rpc_functions:own_layers")
        assert layers == [[0]] * tp + [[1]] * tp  # rank = pp_rank * tp + tp_rank
        core = llm.llm_engine.engine_core.engine_core  # type: ignore[attr-defined]
        assert core.max_batches_in_flight == pp
        assert_no_leak(llm)
        _abort_in_flight(llm, expected)
    finally:
        llm.llm_engine.shutdown()


def _abort_in_flight(llm: LLM, expected: list[list[int]]) -> None:
    engine = llm.llm_engine
    core = engine.engine_core.engine_core  # type: ignore[attr-defined]
    scheduler = core.scheduler
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    engine.step()
    engine.step()  # a micro-batch per stage: r0 and r1, then r2
    newest = core.batch_queue.batches[-1].scheduler_output.num_scheduled_tokens
    assert list(newest) == ["r2"] and "r2" in scheduler.batches.in_flight
    engine.abort_request("r2")
    scheduler.check_integrity()
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        scheduler.check_integrity()
    assert done == {"r0": expected[0], "r1": expected[1]}
    while core.has_work():  # the aborted request's micro-batch comes back
        core.step()
    assert not scheduler.batches.in_flight
    assert_no_leak(llm)
