"""EngineCoreProc over ZMQ through SyncMPClient, with the real default model (one process)."""

from __future__ import annotations

import json
import os
import pickle
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from kvserve.args.engine_args import EngineArgs
from kvserve.engine import core_launcher
from kvserve.engine.core_launcher import prestart_engine_core
from kvserve.engine.exceptions import EngineDeadError
from kvserve.engine.mp_client import SyncMPClient
from kvserve.protocol.core_messages import (
    AbortRequestsMessage,
    AddRequestMessage,
    InputMessage,
    OutputMessage,
    OutputsMessage,
    UtilityCallMessage,
)
from kvserve.protocol.engine_core import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)
from kvserve.sampling_params import SamplingParams
from tests.conftest import TEST_KV_CACHE_MEMORY

PROMPT = list(range(1000, 1040))  # 40 tokens: two full blocks of 16 to share via the prefix cache


def make_request(request_id: str, max_tokens: int, prompt: list[int] = PROMPT) -> EngineCoreRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=params,
        eos_token_id=2,
        arrival_time=time.time(),
    )


def collect(client: SyncMPClient, request_id: str) -> tuple[list[int], EngineCoreOutput]:
    tokens: list[int] = []
    while True:
        for out in client.get_output().outputs:
            if out.request_id == request_id:
                tokens += out.new_token_ids
                if out.finished:
                    return tokens, out


def wait_idle(client: SyncMPClient, timeout: float = 1.0) -> SchedulerStats:
    deadline = time.monotonic() + timeout
    while (stats := client.get_stats()).num_running_reqs or stats.num_waiting_reqs:
        assert time.monotonic() < deadline, f"core still busy: {stats}"
        time.sleep(0.01)
    return stats


# --- the wire (no engine) ------------------------------------------------------------


def test_wire_is_typed_msgpack_never_pickle() -> None:
    encoder = msgspec.msgpack.Encoder()
    add = AddRequestMessage(make_request("r", 4))
    frame = encoder.encode(add)
    # Plain msgpack: any msgpack reader sees the tag and fields, no Python objects.
    raw = msgspec.msgpack.decode(frame)
    assert raw[0] == "add" and raw[1][0] == "r"
    decoder = msgspec.msgpack.Decoder(InputMessage)
    assert decoder.decode(frame) == add
    abort = AbortRequestsMessage(["a", "b"])
    assert decoder.decode(encoder.encode(abort)) == abort
    call = UtilityCallMessage(3, "ping", [1, "x"])
    assert decoder.decode(encoder.encode(call)) == call
    # A pickle is just undecodable bytes to the core, never executed.
    with pytest.raises(msgspec.DecodeError):
        decoder.decode(pickle.dumps(add))
    outputs = EngineCoreOutputs(
        outputs=[
            EngineCoreOutput(
                request_id="r", new_token_ids=[5, 6], finish_reason=FinishReason.LENGTH
            )
        ],
        scheduler_stats=SchedulerStats(num_running_reqs=1),
        timestamp=1.5,
        scheduled_times={"r": 2.0},
    )
    message = msgspec.msgpack.Decoder(OutputMessage).decode(encoder.encode(OutputsMessage(outputs)))
    assert isinstance(message, OutputsMessage)
    assert message.outputs == outputs and message.outputs.scheduled_times == {"r": 2.0}


# --- a live engine-core process ------------------------------------------------------


@pytest.fixture(scope="module")
def client() -> Iterator[SyncMPClient]:
    # As `kvserve serve` starts it: the core spawned (and importing) before the config
    # exists, then taken by the client instead of a new spawn.
    prestart_engine_core()
    prestarted = core_launcher._prestarted
    assert prestarted is not None
    config = EngineArgs(kv_cache_memory=TEST_KV_CACHE_MEMORY).create_engine_config()
    client = SyncMPClient(config)
    assert client.proc.pid == prestarted.proc.pid and core_launcher._prestarted is None
    yield client
    client.shutdown()


@pytest.mark.slow
def test_generate_and_prefix_cache_over_zmq(client: SyncMPClient) -> None:
    assert client.ready.num_gpu_blocks > 2 and client.ready.block_size == 16
    # What comes off the socket is only ever decoded into this union of msgspec Structs.
    assert client.decoder.type == OutputMessage
    client.add_request(make_request("first", 3))
    first, out = collect(client, "first")
    assert len(first) == 3 and out.finish_reason == FinishReason.LENGTH
    client.add_request(make_request("second", 3))
    second, out = collect(client, "second")
    assert second == first  # greedy, same prompt
    assert out.num_cached_tokens == 32  # two full blocks reused
    assert wait_idle(client).kv_cache_usage == 0.0


@pytest.mark.slow
def test_utilities(client: SyncMPClient) -> None:
    assert client.call_utility("ping") == "pong"
    assert client.reset_prefix_cache() is True
    with pytest.raises(RuntimeError, match="unknown engine-core utility 'no_such_method'"):
        client.call_utility("no_such_method")


@pytest.mark.slow
def test_abort_frees_the_request_promptly(client: SyncMPClient) -> None:
    client.add_request(make_request("long", 10_000, prompt=list(range(2000, 2010))))
    while not any(o.request_id == "long" for o in client.get_output().outputs):
        pass
    assert client.get_stats().num_running_reqs == 1
    client.abort_requests(["long"])
    stats = wait_idle(client, timeout=1.0)
    assert stats.kv_cache_usage == 0.0


@pytest.mark.slow
def test_sigterm_exits_cleanly_and_the_client_fails_fast(client: SyncMPClient) -> None:
    client.add_request(make_request("pending", 10_000, prompt=list(range(3000, 3010))))
    errors: list[BaseException] = []

    def drain() -> None:
        try:
            while True:
                client.get_output()
        except BaseException as e:
            errors.append(e)

    reader = threading.Thread(target=drain)
    reader.start()
    assert client.proc.pid is not None
    os.kill(client.proc.pid, signal.SIGTERM)
    reader.join(5)
    assert not reader.is_alive(), "get_output() still blocked after the core exited"
    assert isinstance(errors[0], EngineDeadError)
    assert client.proc.exitcode == 0  # SIGTERM is a clean shutdown, not a crash
    with pytest.raises(EngineDeadError):
        client.add_request(make_request("late", 4))
    with pytest.raises(EngineDeadError):
        client.get_stats()
    tmpdir = client.resources.tmpdir
    assert tmpdir is not None and os.path.isdir(tmpdir)
    client.shutdown()
    assert not os.path.exists(tmpdir)  # ipc socket files removed


@pytest.mark.slow
def test_startup_error_surfaces_in_the_parent(tmp_path: Path) -> None:
    # A model directory with a config but no weights: the parent resolves it, the core
    # process fails to load it and its ValueError must reach the caller, not hang it.
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "eos_token_id": 0,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    engine_config = EngineArgs(model=str(tmp_path), kv_cache_memory=1 << 20).create_engine_config()
    start = time.monotonic()
    with pytest.raises(ValueError, match="safetensors"):
        SyncMPClient(engine_config)
    assert time.monotonic() - start < 60
