"""The profile run behind gpu_memory_utilization on CUDA, checked on the CPU with a tiny
random Llama: the scheduler's largest step runs without a KV cache (none is bound before
or after) and yields the sampler's probabilities for max_num_seqs rows. The measuring
itself needs a GPU (test_gpu_memory_profiler_cuda.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvserve.attention.layer import get_attention_layers
from kvserve.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvserve.worker.gpu_memory_profiler import estimate_cuda_graph_bytes, profile_forward
from kvserve.worker.model_runner import ModelRunner


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    path: Path = tmp_path_factory.mktemp("tiny_llama_profile")
    torch.manual_seed(0)
    hf_config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=128, max_position_embeddings=64,
    )  # fmt: skip
    LlamaForCausalLM(hf_config).save_pretrained(path)
    config = EngineConfig(
        ModelConfig(model=str(path), max_model_len=64),
        CacheConfig(block_size=4),
        SchedulerConfig(max_num_batched_tokens=96, max_num_seqs=8, max_model_len=64),
        device_config=DeviceConfig("cpu"),
    )
    runner = ModelRunner(config, "cpu")
    runner.load_model()
    return runner


def test_profile_run_needs_no_kv_cache(runner: ModelRunner) -> None:
    layers = get_attention_layers(runner.model)
    assert layers and all(layer.kv_cache.numel() == 0 for layer in layers.values())
    # 96 tokens past max_model_len=64: positions wrap, as chunks of long prompts would.
    probs = profile_forward(runner.model, 96, 8, 64, torch.device("cpu"))
    assert probs.shape == (8, 128) and probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(8))
    assert all(layer.kv_cache.numel() == 0 for layer in layers.values())
    # An earlier pipeline stage samples nothing: its hidden states for every token.
    hidden = profile_forward(runner.model, 96, 8, 64, torch.device("cpu"), with_logits=False)
    assert hidden.shape == (96, 32)


def test_no_graphs_are_estimated_off_cuda(runner: ModelRunner) -> None:
    assert estimate_cuda_graph_bytes(runner.config, torch.device("cpu"), runner.model) == 0
