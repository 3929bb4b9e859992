"""Workloads, machine description, GEMM rate and FLOP counting for `kvserve bench peers`.

Everything here is engine-neutral: each engine gets the same list of PeerRequest
(prompt token ids + exact number of output tokens, EOS ignored) and its elapsed time is
turned into tok/s and FLOP/s the same way.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from kvserve.transformers_utils.arch_config import ArchConfig

# Engine arguments of each kvserve variant over the command line's ("kvserve" alone runs
# the defaults: a GGUF model's own blocks, lossless):
# kvserve-float32: --quantization none (every weight dequantized to float32 at load);
# kvserve-gguf: --quantization gguf (the file's Q4_1 blocks, as llama.cpp runs);
# kvserve-gguf-int8: --quantization gguf_int8 (also int8 activations, as llama.cpp computes);
# kvserve-gguf-int8-kv16: and a float16 KV cache, llama.cpp's default.
# Speculative decoding (lossless: outputs equal the target's greedy tokens):
# kvserve-spec-ngram: prompt lookup, 4 drafts; kvserve-spec-int8-draft: the default lossless
# target with its own gguf_int8 copy drafting 3 tokens; kvserve-float32-spec-int8-draft: the
# same drafts for a float32 target.
# kvserve-sync / kvserve-async: the default without / with --async-scheduling (the next
# step scheduled while the forward runs), to compare the two in one run.
_NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}'
_INT8_DRAFT = '{"method": "draft_model", "num_speculative_tokens": 3, "quantization": "gguf_int8"}'
KVSERVE_VARIANTS: dict[str, dict[str, str | bool]] = {
    "kvserve-float32": {"quantization": "none"},
    "kvserve-gguf": {"quantization": "gguf"},
    "kvserve-gguf-int8": {"quantization": "gguf_int8"},
    "kvserve-gguf-int8-kv16": {"quantization": "gguf_int8", "kv_cache_dtype": "float16"},
    "kvserve-spec-ngram": {"speculative_config": _NGRAM},
    "kvserve-spec-int8-draft": {"speculative_config": _INT8_DRAFT},
    "kvserve-float32-spec-int8-draft": {"quantization": "none", "speculative_config": _INT8_DRAFT},
    "kvserve-sync": {"async_scheduling": False},
    "kvserve-async": {"async_scheduling": True},
}
KVSERVE_ENGINES = ("kvserve", *KVSERVE_VARIANTS)


@dataclass(frozen=True)
class WorkloadSpec:
    """Request count and inclusive [low, high] ranges of prompt and output lengths."""

    name: str
    num_requests: int
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]

    def scaled(self, scale: float) -> WorkloadSpec:
        def s(x: int) -> int:
            return max(1, round(x * scale))

        # Single-stream (c) stays single-stream; only its lengths shrink.
        n = self.num_requests if self.num_requests == 1 else s(self.num_requests)
        return WorkloadSpec(
            self.name,
            n,
            (s(self.prompt_len[0]), s(self.prompt_len[1])),
            (s(self.output_len[0]), s(self.output_len[1])),
        )


WORKLOADS: dict[str, WorkloadSpec] = {
    "a": WorkloadSpec("a", 32, (64, 256), (32, 128)),
    "b": WorkloadSpec("b", 64, (128, 1024), (64, 256)),
    "c": WorkloadSpec("c", 1, (32, 32), (256, 256)),
    # Code-editing-like (see make_requests): single stream, the output copies the prompt.
    "e": WorkloadSpec("e", 1, (256, 256), (128, 128)),
}
# Workloads whose prompt is a random passage followed by the start of its repetition, so
# that continuing it means copying from the prompt (as an edit copies most of the code).
COPY_WORKLOADS = ("e",)


@dataclass
class PeerRequest:
    prompt_token_ids: list[int]
    output_len: int


@dataclass
class EngineResult:
    """One engine on one workload. Output tokens count only the requested ones (tokens a
    static batch generates past a request's length are waste, not throughput)."""

    engine: str
    workload: str
    elapsed_s: float
    prompt_tokens: int
    output_tokens: int
    config: str = ""
    flops: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tok_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s


def make_requests(
    spec: WorkloadSpec, vocab_size: int, special_ids: set[int], seed: int
) -> list[PeerRequest]:
    """Random token prompts, deterministic for (spec, seed); special tokens left out so no
    prompt contains an EOS or a chat marker."""
    rng = np.random.default_rng(seed)
    pool = np.array([t for t in range(vocab_size) if t not in special_ids], dtype=np.int64)
    in_lens = rng.integers(spec.prompt_len[0], spec.prompt_len[1] + 1, size=spec.num_requests)
    out_lens = rng.integers(spec.output_len[0], spec.output_len[1] + 1, size=spec.num_requests)
    if spec.name in COPY_WORKLOADS:
        return [
            PeerRequest(_copy_prompt(rng.choice(pool, size=int(p)).tolist(), int(o)), int(o))
            for p, o in zip(in_lens, out_lens, strict=True)
        ]
    return [
        PeerRequest(rng.choice(pool, size=int(p)).tolist(), int(o))
        for p, o in zip(in_lens, out_lens, strict=True)
    ]


def _copy_prompt(tokens: list[int], output_len: int) -> list[int]:
    """A passage, then its first tokens again: the passage is len - output_len tokens long
    (at least half), so a model continuing the repetition copies its next output_len."""
    passage = tokens[: max(len(tokens) - output_len, (len(tokens) + 1) // 2)]
    return passage + passage[: len(tokens) - len(passage)]


def matmul_params(arch: ArchConfig) -> tuple[int, int]:
    """(weights multiplied per processed token in the layers, lm_head weights).

    The embedding lookup is not a matmul; the lm_head is counted once per sampled token."""
    h, i = arch.hidden_size, arch.intermediate_size
    q = arch.num_attention_heads * arch.head_dim
    kv = arch.num_key_value_heads * arch.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i
    return arch.num_hidden_layers * per_layer, arch.vocab_size * h


def workload_flops(arch: ArchConfig, requests: list[PeerRequest]) -> float:
    """Useful FLOPs: 2 x layer weights x every processed token, 2 x lm_head x every sampled
    token, plus causal attention (QK^T and PV, 4 x heads x head_dim per context position)."""
    layer_params, head_params = matmul_params(arch)
    attn_per_pos = 4 * arch.num_attention_heads * arch.head_dim * arch.num_hidden_layers
    total = 0.0
    for r in requests:
        n_proc = (
            len(r.prompt_token_ids) + r.output_len - 1
        )  # the last sampled token is never fed back
        total += 2.0 * layer_params * n_proc + 2.0 * head_params * r.output_len
        # Token at position t (0-based) attends to t + 1 positions.
        total += attn_per_pos * n_proc * (n_proc + 1) / 2
    return total


def gemm_rate(n: int = 2048, repeats: int = 5) -> float:
    """Best-of float32 torch.mm rate in FLOP/s with torch's current thread setting."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)  # warm up the BLAS thread pool
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


def machine_info() -> dict[str, Any]:
    import torch

    model, flags = platform.processor() or "unknown", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
    except OSError:
        pass
    simd = [
        f
        for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile")
        if f in flags
    ]
    return {
        "cores": os.cpu_count(),
        "cpu_model": model,
        "simd_flags": simd,
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_avg": os.getloadavg(),
    }
