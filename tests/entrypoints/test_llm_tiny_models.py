"""Tiny random Llama (llama3 rope scaling) and Qwen2 models, saved as HF directories, run
through LLM end to end and token-exact against transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve.entrypoints.llm import LLM
from kvserve.sampling_params import SamplingParams
from tests.reference import assert_no_leak

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a paged kv cache keeps blocks of keys and values",
    "prefix caching shares blocks between requests with the same prompt",
    "continuous batching mixes prefill chunks and decode steps",
] * 20


def save_tokenizer(directory: Path) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")
    fast.save_pretrained(directory)
    return fast


def build_model(kind: str, directory: Path) -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    tokenizer = save_tokenizer(directory)
    common: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        initializer_range=0.2,
    )
    if kind == "llama":
        config = LlamaConfig(
            **common,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    else:
        config = Qwen2Config(
            **common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}
        )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    model.save_pretrained(directory)
    return model


@torch.inference_mode()
def hf_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out: list[int] = []
    for _ in range(n):
        next_id = int(model(ids).logits[0, -1].argmax())
        out.append(next_id)
        ids = torch.cat([ids, torch.tensor([[next_id]])], dim=1)
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tiny_model_matches_transformers(tmp_path: Path, kind: str) -> None:
    reference = build_model(kind, tmp_path)
    # Block size 4 and a small budget: prefix hits and chunked prefill on a tiny model.
    llm = LLM(str(tmp_path), block_size=4, max_num_batched_tokens=16, kv_cache_memory=8 << 20)
    prompts = [llm.get_tokenizer().encode(text) for text in CORPUS[:4]]
    prompts.append(prompts[0] + prompts[1])
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert list(output.outputs[0].token_ids) == hf_greedy(reference, prompt, 24)
    again = llm.generate({"prompt_token_ids": prompts[-1]}, params, use_tqdm=False)[0]
    assert again.num_cached_tokens == (len(prompts[-1]) - 1) // 4 * 4
    assert again.outputs[0].token_ids == outputs[-1].outputs[0].token_ids
    assert_no_leak(llm)
    llm.llm_engine.shutdown()
