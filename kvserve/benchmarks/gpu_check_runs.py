"""The GPU check's measured parts (gpu_check.py runs them): greedy tokens on CUDA against
the CPU float32 path, decode speed with and without CUDA graphs, the nano-vllm-shaped
throughput run and the Qwen3-0.6B-shaped random model it needs.

Each function starts and shuts down its own engines, so one part's failure or memory
leaves the next part a clean device.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

# Short prompts whose greedy continuations are long enough to drift if the numerics do.
GREEDY_PROMPTS = (
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
)
GREEDY_TOKENS = 32
# nano-vllm's benchmark: 256 sequences, input and output lengths uniform in 100..1024.
# `kvserve bench throughput` draws lengths in mean * [1 - ratio, 1 + ratio]; this mean
# and ratio give int(562 * 0.178) = 100 .. int(562 * 1.822) = 1023.
NANO_VLLM_NUM_SEQS = 256
NANO_VLLM_MEAN_LEN = 562
NANO_VLLM_RANGE_RATIO = 0.822
# Qwen3-0.6B's config.json shape (Qwen/Qwen3-0.6B): what nano-vllm's benchmark runs.
QWEN3_0_6B_SHAPE: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}


def _greedy(model: str, **engine_kwargs: Any) -> list[list[int]]:
    from kvserve.entrypoints.llm import LLM
    from kvserve.sampling_params import SamplingParams

    llm = LLM(model=model, max_model_len=512, kv_cache_memory="256M", **engine_kwargs)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
        outputs = llm.generate(list(GREEDY_PROMPTS), params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]
    finally:
        llm.llm_engine.shutdown()


def matching_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy outputs share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def greedy_vs_cpu(model: str, label: str) -> list[str]:
    """Report lines: CUDA float32 (eager and graphs) and bfloat16 against the CPU float32
    path, as the number of leading tokens each prompt shares with it."""
    reference = _greedy(model, device="cpu", dtype="float32")
    lines = [f"### greedy tokens, {label} ({GREEDY_TOKENS} tokens per prompt)", ""]
    runs: dict[str, dict[str, Any]] = {
        "cuda float32, eager": {"dtype": "float32", "enforce_eager": True},
        "cuda float32, CUDA graphs": {"dtype": "float32"},
        "cuda bfloat16 (default), CUDA graphs": {},
    }
    for name, kwargs in runs.items():
        got = _greedy(model, device="cuda", **kwargs)
        shared = [matching_prefix(r, g) for r, g in zip(reference, got, strict=True)]
        exact = sum(s == GREEDY_TOKENS for s in shared)
        lines.append(
            f"- {name}: {exact}/{len(shared)} prompts token-exact; "
            f"leading tokens shared per prompt {shared}"
        )
    return [*lines, ""]


def decode_speed(model: str, batch_sizes: tuple[int, ...] = (1, 16, 64)) -> list[str]:
    """Output tok/s of decode-heavy batches (short prompts, 256 tokens each), eager and
    with CUDA graphs, in the same process one after the other."""
    from kvserve.entrypoints.llm import LLM
    from kvserve.sampling_params import SamplingParams

    lines = ["### decode tok/s, with and without CUDA graphs", ""]
    lines += ["| batch | eager tok/s | CUDA graphs tok/s | ratio |", "|---|---|---|---|"]
    results: dict[tuple[int, bool], float] = {}
    for eager in (True, False):
        llm = LLM(model=model, device="cuda", enforce_eager=eager, max_model_len=1024)
        try:
            params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
            llm.generate(["warm up"], SamplingParams(max_tokens=8), use_tqdm=False)
            for n in batch_sizes:
                prompts = [f"Story number {i}:" for i in range(n)]
                start = time.perf_counter()
                outputs = llm.generate(prompts, params, use_tqdm=False)
                elapsed = time.perf_counter() - start
                tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
                results[(n, eager)] = tokens / elapsed
        finally:
            llm.llm_engine.shutdown()
    for n in batch_sizes:
        eager_rate, graph_rate = results[(n, True)], results[(n, False)]
        lines.append(
            f"| {n} | {eager_rate:.1f} | {graph_rate:.1f} | {graph_rate / eager_rate:.2f}x |"
        )
    return [*lines, ""]


def write_qwen3_0_6b_random(directory: Path, **overrides: Any) -> Path:
    """A Qwen3ForCausalLM checkpoint with Qwen3-0.6B's shape (``overrides`` shrink it in
    tests) and random weights, saved as bfloat16 safetensors: speed does not depend on
    the weights' values, and no hub is reachable."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**{**QWEN3_0_6B_SHAPE, **overrides})
    torch.manual_seed(0)
    # Random values drawn straight into bfloat16 tensors: init_weights on 0.6B parameters
    # in float32 would take a CPU minute of the check's eight.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def nano_vllm_throughput_args(
    model_dir: Path, tokenizer: str, output_json: Path, num_seqs: int = NANO_VLLM_NUM_SEQS
) -> list[str]:
    """`kvserve bench throughput`'s arguments for nano-vllm's shape. The tokenizer is the
    default model's (only prompts' token ids come from it: they stay inside Qwen3's
    vocabulary); the KV cache holds every sequence at its longest."""
    max_len = 2 * int(NANO_VLLM_MEAN_LEN * (1 + NANO_VLLM_RANGE_RATIO)) + 16
    return [
        "bench", "throughput",
        "--model", str(model_dir),
        "--tokenizer", tokenizer,
        "--num-prompts", str(num_seqs),
        "--input-len", str(NANO_VLLM_MEAN_LEN),
        "--output-len", str(NANO_VLLM_MEAN_LEN),
        "--range-ratio", str(NANO_VLLM_RANGE_RATIO),
        "--max-model-len", str(max_len),
        "--max-num-seqs", str(num_seqs),
        "--max-num-batched-tokens", "16384",
        "--gpu-memory-utilization", "0.8",
        "--output-json", str(output_json),
        "--disable-tqdm",
    ]  # fmt: skip
