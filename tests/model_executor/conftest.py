"""Tiny random HF checkpoints and a minimal paged "model runner" for model tests."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from kvserve.attention.backends.registry import get_attn_backend
from kvserve.attention.backends.utils import make_common_attn_metadata
from kvserve.attention.layer import allocate_kv_caches, bind_kv_cache
from kvserve.forward_context import set_forward_context

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "initializer_range": 0.1,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def _save(model: PreTrainedModel, path: Path, **kwargs: object) -> PreTrainedModel:
    model.save_pretrained(path, **kwargs)
    return model.eval()


def make_tiny_llama(path: Path) -> PreTrainedModel:
    torch.manual_seed(0)
    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    config = LlamaConfig(**TINY, rope_parameters=rope, tie_word_embeddings=False)
    return _save(LlamaForCausalLM(config), path)


def make_tiny_qwen2(path: Path) -> PreTrainedModel:
    torch.manual_seed(1)
    config = Qwen2Config(**TINY, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # HF zero-initialises biases; make them matter
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.5)
    # A small shard size forces model.safetensors.index.json + several files.
    return _save(model, path, max_shard_size="100KB")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PreTrainedModel]:
    path = tmp_path_factory.mktemp("tiny_llama")
    return path, make_tiny_llama(path)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PreTrainedModel]:
    path = tmp_path_factory.mktemp("tiny_qwen2")
    return path, make_tiny_qwen2(path)


def gguf_writer(path: Path, arch: str, cfg: Any) -> Any:
    """A ``gguf.GGUFWriter`` with the header every tiny test GGUF carries, from an HF
    config (plain RoPE, base 10000; EOS 2)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(cfg.vocab_size)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    return w


class PagedRunner:
    """Just enough of a model runner: per-request block lists drawn from a shuffled
    pool (so block tables are non-contiguous), slot mapping, one forward per step."""

    def __init__(self, model: nn.Module, block_size: int = 4, num_blocks: int = 64) -> None:
        self.model = model
        self.block_size = block_size
        self.free = list(range(num_blocks))
        random.Random(0).shuffle(self.free)
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        bind_kv_cache(model, allocate_kv_caches(model, num_blocks, block_size, "cpu"))
        self.builder = get_attn_backend("cpu").get_builder_cls()(block_size, "cpu")

    @torch.no_grad()
    def step(self, batch: list[tuple[str, list[int]]]) -> list[torch.Tensor]:
        """Schedule ``(request_id, new_token_ids)`` pairs; returns per-request logits
        ``[len(new_token_ids), vocab]``."""
        ids, positions, query_lens, computed, tables = [], [], [], [], []
        for req, tokens in batch:
            start = self.computed.setdefault(req, 0)
            blocks = self.blocks.setdefault(req, [])
            while len(blocks) * self.block_size < start + len(tokens):
                blocks.append(self.free.pop())
            ids += tokens
            positions += range(start, start + len(tokens))
            query_lens.append(len(tokens))
            computed.append(start)
            tables.append(blocks)
        common = make_common_attn_metadata(query_lens, computed, tables, self.block_size)
        with set_forward_context(self.builder.build(common)):
            hidden = self.model(torch.tensor(ids), torch.tensor(positions))
        logits = self.model.compute_logits(hidden)
        for req, tokens in batch:
            self.computed[req] += len(tokens)
        return list(logits.split(query_lens))


@pytest.fixture
def paged_runner() -> Callable[..., PagedRunner]:
    return PagedRunner
