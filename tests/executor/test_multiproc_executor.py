"""MultiprocExecutor with tensor parallelism on a tiny random Llama that has fewer KV heads
than ranks (its one KV head is replicated on both): greedy tokens equal transformers', in
float32 (safetensors) and on the GGUF file's own Q8_0 blocks (each rank holding its
block shard); collective_rpc across processes; a killed worker fails the engine fast."""

from __future__ import annotations

import copy
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import msgspec
import pytest
import torch
from gguf import GGMLQuantizationType
from transformers import LlamaConfig, LlamaForCausalLM

from kvserve.entrypoints.llm import LLM
from kvserve.executor.abstract import ExecutorFailedError
from kvserve.executor.multiproc_executor import MultiprocExecutor
from kvserve.sampling_params import SamplingParams
from tests.executor import rpc_functions
from tests.model_executor.conftest import gguf_writer
from tests.model_executor.test_gguf_loader import _HF_TO_GGUF, llama_cpp_permute
from tests.reference import assert_no_leak

PROMPTS = [[5, 17, 99, 3, 42, 7], [200, 11, 64, 128, 9, 31, 77, 250, 4], [8]]
MAX_TOKENS = 12


def _tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,  # fewer than the 2 ranks: replicated
        vocab_size=256,
        max_position_embeddings=256,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return LlamaForCausalLM(config).float().eval()


def _write_gguf(hf: LlamaForCausalLM, path: Path) -> LlamaForCausalLM:
    """Every 2-D weight as Q8_0 blocks; returns the HF model holding the same (rounded)
    weights, the reference for the block path."""
    cfg = hf.config
    reference = copy.deepcopy(hf)
    state = reference.state_dict()
    w = gguf_writer(path, "llama", cfg)
    for name, tensor in hf.state_dict().items():
        arr = tensor.float().numpy()
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{_HF_TO_GGUF[module]}.{kind}"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight",
                     "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]  # fmt: skip
        if arr.ndim == 2:
            q = gguf.quants.quantize(arr, GGMLQuantizationType.Q8_0)
            deq = gguf.quants.dequantize(q, GGMLQuantizationType.Q8_0).reshape(arr.shape)
            state[name].copy_(torch.from_numpy(deq))
            if name.endswith("q_proj.weight"):
                q = gguf.quants.quantize(
                    llama_cpp_permute(arr, cfg.num_attention_heads), GGMLQuantizationType.Q8_0
                )
            elif name.endswith("k_proj.weight"):
                q = gguf.quants.quantize(
                    llama_cpp_permute(arr, cfg.num_key_value_heads), GGMLQuantizationType.Q8_0
                )
            w.add_tensor(gname, q, raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return reference


@torch.inference_mode()
def _hf_greedy(model: Any, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out: list[int] = []
    for _ in range(MAX_TOKENS):
        nxt = int(model(ids).logits[0, -1].argmax())
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("tp_tiny_llama")
    hf = _tiny_llama()
    hf.save_pretrained(root / "hf")
    gguf_ref = _write_gguf(hf, root / "tiny.gguf")
    return {"hf": (str(root / "hf"), hf), "gguf": (str(root / "tiny.gguf"), gguf_ref)}


def _llm(path: str, tp: int, **kwargs: Any) -> LLM:
    return LLM(
        path, skip_tokenizer_init=True, tensor_parallel_size=tp, block_size=4,
        max_num_batched_tokens=16, kv_cache_memory=4 << 20, **kwargs,
    )  # fmt: skip


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def tp2(checkpoints: dict[str, Any]) -> Iterator[LLM]:
    llm = _llm(checkpoints["hf"][0], 2)
    yield llm
    llm.llm_engine.shutdown()


def _executor(llm: LLM) -> MultiprocExecutor:
    executor = llm.llm_engine.engine_core.engine_core.model_executor  # type: ignore[attr-defined]
    assert isinstance(executor, MultiprocExecutor)
    return executor


def test_tp2_float32_matches_transformers(tp2: LLM, checkpoints: dict[str, Any]) -> None:
    hf = checkpoints["hf"][1]
    assert _greedy(tp2) == [_hf_greedy(hf, p) for p in PROMPTS]
    assert_no_leak(tp2)


def test_tp2_gguf_blocks_match_tp1_and_transformers(checkpoints: dict[str, Any]) -> None:
    path, reference = checkpoints["gguf"]
    expected = [_hf_greedy(reference, p) for p in PROMPTS]
    tp1 = _llm(path, 1, quantization="gguf")
    try:
        assert _greedy(tp1) == expected
    finally:
        tp1.llm_engine.shutdown()
    llm = _llm(path, 2, quantization="gguf")
    try:
        assert _greedy(llm) == expected
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
    assert len(_greedy(tp2)) == len(PROMPTS)


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
        _greedy(tp2)
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
    llm = _llm(checkpoints["hf"][0], 2)
    try:
        victim = _executor(llm).resources.procs[1]
        os.kill(victim.pid or 0, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(
            ExecutorFailedError, match=r"worker 1 \(pid \d+\) died with exit code -9"
        ):
            _greedy(llm)
        assert time.monotonic() - start < 10
    finally:
        llm.llm_engine.shutdown()
    assert not any(p.is_alive() for p in _executor(llm).resources.procs)
