"""Which engines capture CUDA graphs: none on a CPU, none with --enforce-eager, none
where a feature runs host work per layer; those cases run the model eagerly."""

from __future__ import annotations

import logging

import pytest
import torch

from kvserve.args.engine_args import EngineArgs
from kvserve.attention.backends.cpu_attn import CPUAttentionMetadataBuilder
from kvserve.attention.backends.triton_attn import TritonAttentionMetadataBuilder
from kvserve.config import EngineConfig
from kvserve.worker.cuda_graph_runner import (
    NoCUDAGraphs,
    graphs_unsupported,
    make_cuda_graph_runner,
)


@pytest.fixture(scope="module")
def config() -> EngineConfig:
    return EngineArgs(max_model_len=256, max_num_seqs=16).create_engine_config()


def test_cpu_runs_eagerly(config: EngineConfig) -> None:
    builders = [TritonAttentionMetadataBuilder(16, "cpu")]
    runner = make_cuda_graph_runner(config, torch.device("cpu"), builders, {}, [16])
    assert type(runner) is NoCUDAGraphs and runner.captured_sizes == ()


def test_builders_with_host_work_keep_graphs_off(config: EngineConfig) -> None:
    assert graphs_unsupported(config, [TritonAttentionMetadataBuilder(16, "cpu")]) == ""
    why = graphs_unsupported(config, [CPUAttentionMetadataBuilder(16, "cpu")])
    assert "CPUAttentionMetadataBuilder" in why


def test_features_with_per_layer_host_work_keep_graphs_off() -> None:
    config = EngineArgs(max_model_len=256, enable_lora=True).create_engine_config()
    assert graphs_unsupported(config, []) == "not captured with LoRA"


def test_enforce_eager_means_no_runner_even_on_cuda(caplog: pytest.LogCaptureFixture) -> None:
    config = EngineArgs(max_model_len=256, enforce_eager=True).create_engine_config()
    builders = [TritonAttentionMetadataBuilder(16, "cpu")]
    with caplog.at_level(logging.INFO):
        runner = make_cuda_graph_runner(config, torch.device("cuda"), builders, {}, [16])
    assert type(runner) is NoCUDAGraphs


def test_no_graphs_forward_is_the_model_call() -> None:
    calls = []

    def model(input_ids: torch.Tensor, positions: torch.Tensor, **kw: object) -> torch.Tensor:
        calls.append(kw)
        return input_ids + positions

    from kvserve.worker.input_preparation import StepInputs

    inputs = StepInputs.__new__(StepInputs)
    inputs.input_ids, inputs.positions = torch.tensor([1, 2]), torch.tensor([10, 20])
    out = NoCUDAGraphs().forward(model, inputs, {"pixel_values": None})
    assert out.tolist() == [11, 22] and calls == [{"pixel_values": None}]
