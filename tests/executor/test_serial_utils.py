"""The executor's wire format: every message is plain msgpack (decodable by any msgpack
reader, no pickle), decoded back against its declared type: SchedulerOutput with each
connector's own metadata class, ModelRunnerOutput with logprob tensors, GrammarOutput
with its numpy bitmask; and the one real engine path where connector metadata crosses to
a worker process (SharedStorageConnector under the mp executor)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from kvserve.distributed.kv_transfer.kv_connector.connectors.multi import (
    MultiKVConnectorMetadata,
)
from kvserve.distributed.kv_transfer.kv_connector.connectors.shared_storage import (
    LoadSpec,
    SaveSpec,
    SharedStorageConnectorMetadata,
)
from kvserve.distributed.kv_transfer.kv_connector.connectors.tiered_cache import (
    TieredCacheConnectorMetadata,
    TransferSpec,
)
from kvserve.entrypoints.llm import LLM
from kvserve.executor import serial_utils as wire
from kvserve.lora.request import LoRARequest
from kvserve.protocol.kv_blend import BlendSpec
from kvserve.protocol.kv_connector_output import KVConnectorOutput
from kvserve.protocol.runner_output import LogprobsLists, LogprobsTensors, ModelRunnerOutput
from kvserve.protocol.scheduler_output import (
    CachedRequestData,
    GrammarOutput,
    NewRequestData,
    SchedulerOutput,
)
from kvserve.sampling_params import SamplingParams
from tests.conftest import TEST_KV_CACHE_MEMORY
from tests.distributed.kv_transfer.helpers import as_json, shared_storage
from tests.reference import hf_reference


def _plain(frame: bytes) -> Any:
    """What any msgpack reader sees: the frame decodes without kvserve's hooks."""
    return msgspec.msgpack.decode(frame)


def _scheduler_output() -> SchedulerOutput:
    meta = MultiKVConnectorMetadata(
        metadata=(
            SharedStorageConnectorMetadata(
                loads=[LoadSpec("a", "k1", 0, 2, [[3, 4]])], saves=[SaveSpec("b", "k2", [[5]])]
            ),
            TieredCacheConnectorMetadata(
                saves=[TransferSpec("b", [1, 2, 3], 0, 3, [[5]], (("salt", "s"),))],
                blends=[BlendSpec("c", [1, 3, 4, 2], 0, 4, 0.15)],
            ),
        ),
        extra_async_saves={"b": 1},
    )
    new = NewRequestData(
        req_id="a",
        prompt_token_ids=[1, 2, 3],
        sampling_params=SamplingParams(temperature=0.7, top_k=5, seed=3, max_tokens=9),
        block_ids=([3, 4], [7]),
        num_computed_tokens=0,
        lora_request=LoRARequest("adapter", 1, "/x"),
    )
    cached = CachedRequestData(["b"], [False], [([6], [8])], [16], [2])
    return SchedulerOutput(
        [new], cached, {"a": 3, "b": 2}, 5,
        num_common_prefix_blocks=(1, 0), finished_req_ids={"z"}, preempted_req_ids={"y"},
        kv_connector_metadata=meta, scheduled_spec_decode_tokens={"b": [11]},
    )  # fmt: skip


def test_scheduler_output_round_trips_with_each_connectors_metadata_class() -> None:
    original = _scheduler_output()
    frame = wire.encode(original)
    plain = _plain(frame)
    assert isinstance(plain, dict) and "scheduled_new_reqs" in plain
    decoded = wire.decode(frame, SchedulerOutput)
    assert decoded == original
    meta = decoded.kv_connector_metadata
    assert isinstance(meta, MultiKVConnectorMetadata)
    assert [type(m) for m in meta.metadata] == [
        SharedStorageConnectorMetadata,
        TieredCacheConnectorMetadata,
    ]
    # The engine's own object was not touched by the encoding.
    assert isinstance(original.kv_connector_metadata, MultiKVConnectorMetadata)


def test_runner_and_grammar_outputs_carry_tensors_as_raw_bytes() -> None:
    logits_rows = LogprobsTensors(
        torch.tensor([[5, 1], [6, 2]]),
        torch.tensor([[-0.5, -1.25], [-0.1, -3.0]]),
        torch.tensor([1, 2]),
    )
    output = ModelRunnerOutput(
        req_ids=["a", "b"],
        req_id_to_index={"a": 0, "b": 1},
        sampled_token_ids=[[5], []],
        logprobs=LogprobsLists([[5, 1]], [[-0.5, -1.25]], [1]),
        prompt_logprobs_dict={"a": logits_rows, "b": None},
        kv_connector_output=KVConnectorOutput(finished_sending={"a"}),
    )
    frame = wire.encode(output)
    ext = _plain(frame)["prompt_logprobs_dict"]["a"][1]
    assert isinstance(ext, msgspec.msgpack.Ext)  # a header and the float32 bytes, as sent
    assert ext.data.endswith(np.float32([-0.5, -1.25, -0.1, -3.0]).tobytes())
    decoded = wire.decode(frame, ModelRunnerOutput)
    got = decoded.prompt_logprobs_dict["a"]
    assert got is not None and all(torch.equal(x, y) for x, y in zip(got, logits_rows, strict=True))
    assert decoded.logprobs == output.logprobs and decoded.kv_connector_output == KVConnectorOutput(
        finished_sending={"a"}
    )

    mask = np.arange(12, dtype=np.int32).reshape(2, 6)
    grammar = wire.decode(wire.encode(GrammarOutput(["a", "b"], mask)), GrammarOutput)
    np.testing.assert_array_equal(grammar.grammar_bitmask, mask)
    bf16 = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    assert torch.equal(wire.decode(wire.encode(bf16), torch.Tensor), bf16)


def test_kv_cache_specs_keep_their_attention_type() -> None:
    from kvserve.protocol.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        SinkFullAttentionSpec,
        SlidingWindowSpec,
    )

    full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64)
    window = SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=64, sliding_window=512)
    sink = SinkFullAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=64, sliding_window=64, sink_len=4
    )
    frames = {n: wire.spec_to_frame(s) for n, s in {"a": full, "b": window, "c": sink}.items()}
    decoded = wire.decode(wire.encode(frames), dict[str, wire.SpecFrame])
    assert {n: wire.spec_from_frame(f) for n, f in decoded.items()} == {
        "a": full,
        "b": window,
        "c": sink,
    }
    config = KVCacheConfig(
        7, [KVCacheGroupSpec(["a"], full), KVCacheGroupSpec(["b"], window)],
        [KVCacheTensor(["a", "b"])],
    )  # fmt: skip
    frame = wire.encode(wire.KVCacheConfigFrame.of(config))
    assert wire.decode(frame, wire.KVCacheConfigFrame).config() == config
    # Plain dataclass decoding would have lost the subclass: the frames exist for that.
    assert type(wire.decode(wire.encode(window), FullAttentionSpec)) is FullAttentionSpec


def test_untyped_or_foreign_payloads_are_refused() -> None:
    with pytest.raises(NotImplementedError, match="no kvserve wire encoding"):
        wire.encode(object())
    with pytest.raises(TypeError, match="object arrays"):
        wire.encode(np.array([object()], dtype=object))
    # A frame naming anything but a connector metadata dataclass is not instantiated.
    frame = msgspec.msgpack.encode(
        {"scheduled_new_reqs": [], "scheduled_cached_reqs": {}, "num_scheduled_tokens": {},
         "total_num_scheduled_tokens": 0, "kv_connector_metadata": ["os:system", {}]}
    )  # fmt: skip
    with pytest.raises(msgspec.ValidationError, match="not a KVConnectorMetadata"):
        wire.decode(frame, SchedulerOutput)


@pytest.mark.slow
def test_connector_metadata_reaches_a_worker_process(tmp_path: Path) -> None:
    """SharedStorageConnector's plan rides on SchedulerOutput to a worker process (mp
    executor, one rank): the first engine saves, the second loads, tokens stay exact."""
    config = as_json(shared_storage(tmp_path))
    ids = list(range(100, 160))
    expected = hf_reference().greedy(ids, 8)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    hits = []
    for _ in range(2):
        llm = LLM(
            distributed_executor_backend="mp",
            kv_cache_memory=TEST_KV_CACHE_MEMORY,
            kv_transfer_config=config,
        )
        try:
            [out] = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
        finally:
            llm.llm_engine.shutdown()
        assert list(out.outputs[0].token_ids) == expected
        hits.append(out.num_cached_tokens)
    assert hits == [0, 48]
