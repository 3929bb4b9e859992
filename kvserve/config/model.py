"""The model: what to load, its numerics and context length (ModelConfig)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.pooling_params import PoolerConfig
from kvserve.sampling_params import SamplingParams
from kvserve.transformers_utils.arch_config import ArchConfig, load_arch_config
from kvserve.transformers_utils.generation_config import load_generation_defaults
from kvserve.transformers_utils.local_model import check_load_format
from kvserve.transformers_utils.model_resolver import ResolvedModel, resolve_model
from kvserve.transformers_utils.pooling_config import resolve_runner

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
GiB = 1 << 30
# --quantization: "gguf" keeps the GGUF file's own Q4_1/Q8_0/Q4_0 blocks (lossless; the
# default for GGUF models); "gguf_int8" multiplies the same blocks with int8-quantized
# activations, as llama.cpp's CPU backend does (faster, lossy);
# "q8_0" quantizes any model's float32 linear weights to Q8_0 blocks.
QUANTIZATION_METHODS = ("gguf", "gguf_int8", "q8_0")
# --quantization none (or float32): dequantize every weight to float32 at load.
NO_QUANTIZATION = ("none", "float32")
# Bytes of the scale after each int8 (token, head) row (a bfloat16).
INT8_KV_SCALE_BYTES = 2
# int8: a quantized cache (attention/backends/kv_cache_codec.py), ~2x float16's tokens
# per byte. vLLM's fp8 names take the same int8 path: a CPU has no fp8 arithmetic, and
# int8 with a scale per head row keeps 7 bits of magnitude where e4m3 keeps 3.
QUANTIZED_KV_CACHE_DTYPES = ("int8", "fp8", "fp8_e4m3", "fp8_e5m2")
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", *QUANTIZED_KV_CACHE_DTYPES)
# --dtype: the weights' and activations' type. "auto" is float32 on a CPU (the lossless
# path, and the C++ kernels' type) and bfloat16 on CUDA (vLLM's default for the
# bfloat16 checkpoints most models ship; GGUF blocks dequantize to float32, then cast).
MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"float": "float32", "half": "float16"}


def resolve_dtype(dtype: str, device: str) -> str:
    """The concrete model dtype for ``dtype`` (one of MODEL_DTYPES or an alias) on
    ``device`` ("cpu" or "cuda"). A CPU computes in float32 only: its kernels, the fused
    decode stack and the GGUF block path all assume it."""
    name = _DTYPE_ALIASES.get(dtype, dtype)
    if name not in MODEL_DTYPES:
        raise ValueError(f"dtype must be one of {MODEL_DTYPES} (or float, half), got {dtype!r}")
    if name == "auto":
        return "bfloat16" if device == "cuda" else "float32"
    if device != "cuda" and name != "float32":
        raise ValueError(f"dtype={dtype!r} needs a CUDA device: the CPU path computes in float32")
    return name


@dataclass
class ModelConfig:
    model: str | None = DEFAULT_MODEL
    tokenizer: str | None = None
    # One of MODEL_DTYPES; "auto" is resolved by EngineConfig for its device.
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    served_model_name: str | None = None
    # None: the model's default ("gguf" for a GGUF file, float32 otherwise); resolved in
    # __post_init__ to a method of QUANTIZATION_METHODS, or None for float32 weights.
    quantization: str | None = None
    # vLLM's flag: decode rows sharing a long prefix attend to it once (cascade attention)
    # unless this is set; tests and `kvserve bench cascade` compare the two.
    disable_cascade_attn: bool = False
    # vLLM's skip_tokenizer_init: the front end builds no tokenizer (token ids in and out).
    skip_tokenizer_init: bool = False
    # Out-of-tree models registered in the front end, ("Arch", "module:Class"); the worker
    # registers them again, since the engine core may run in a fresh process.
    model_registrations: tuple[tuple[str, str], ...] = ()
    # Custom logits processors (vLLM's `logits_processors`): LogitsProcessor subclasses or
    # "package.module:Class" paths, run after the built-ins in every batch. Loaded by the
    # worker (this layer cannot import them); EngineArgs checks that they load.
    logits_processors: tuple[str | type, ...] = ()
    # vLLM's cap on logprobs / prompt_logprobs per request (-1: the whole vocabulary).
    max_logprobs: int = 20
    # vLLM's: the engine may sleep (free its KV cache, and its weights at level 2).
    enable_sleep_mode: bool = False
    # Where default sampling parameters come from: "auto" (the model's generation config),
    # "vllm" (none) or a folder with a generation_config.json; overrides go on top.
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] | None = None
    # vLLM's load_format, checked against the model's format ("auto" reads any).
    load_format: str = "auto"
    # vLLM's runner / task: "generate" samples tokens, "pooling" returns one vector per
    # prompt (task "embed" / "encode"); "auto" picks from the architecture.
    runner: str = "auto"
    task: str | None = None
    # The pooler of a pooling runner (None: the model's defaults, resolved here).
    pooler_config: PoolerConfig | None = None
    # Whether `quantization` is that default rather than asked for: a default "gguf" falls
    # back to float32 where its kernels cannot run (no compiler, a CUDA device).
    quantization_is_default: bool = field(init=False, default=False)
    resolved: ResolvedModel = field(init=False)
    arch: ArchConfig = field(init=False)
    tokenizer_resolved: ResolvedModel = field(init=False)
    # SamplingParams field -> value from the generation config (vLLM's diff_sampling_param).
    generation_defaults: dict[str, Any] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.resolved = resolve_model(self.model)
        check_load_format(self.load_format, self.resolved)
        # A separate tokenizer source (a GGUF or HF directory); the model's own by default.
        self.tokenizer_resolved = resolve_model(self.tokenizer) if self.tokenizer else self.resolved
        self.arch = load_arch_config(self.resolved)
        # Checked now; "auto" stays until EngineConfig knows the device (resolve_dtype).
        self.dtype = _DTYPE_ALIASES.get(self.dtype, self.dtype)
        if self.dtype not in MODEL_DTYPES:
            raise ValueError(
                f"dtype must be one of {MODEL_DTYPES} (or float, half), got {self.dtype!r}"
            )
        limit = self.arch.max_position_embeddings
        if self.max_model_len is None:
            self.max_model_len = limit
        elif not 0 < self.max_model_len <= limit:
            raise ValueError(
                f"max_model_len must be in [1, {limit}] (the model's max_position_embeddings), "
                f"got {self.max_model_len}"
            )
        if self.served_model_name is None:
            self.served_model_name = self.resolved.name
        self._resolve_quantization()
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 or more, got {self.max_logprobs}")
        self.generation_defaults = load_generation_defaults(
            self.resolved, self.generation_config, self.override_generation_config
        )
        try:  # checked now, not on the first request that uses them
            SamplingParams(**self.generation_defaults)
        except ValueError as exc:
            raise ValueError(f"generation config of {self.model!r}: {exc}") from None
        self.runner, self.pooler_config = resolve_runner(
            self.runner, self.task, self.pooler_config, self.resolved, self.arch
        )

    def get_diff_sampling_param(self) -> dict[str, Any]:
        """The sampling defaults the generation config sets (vLLM's name), a fresh dict."""
        return dict(self.generation_defaults)

    @property
    def is_pooling(self) -> bool:
        return self.runner == "pooling"

    @property
    def is_encoder_only(self) -> bool:
        """Bidirectional attention: a prompt is computed whole, its KV never reused."""
        return self.arch.is_encoder_only

    def _resolve_quantization(self) -> None:
        if self.quantization is None:
            self.quantization_is_default = self.resolved.format == "gguf"
            self.quantization = "gguf" if self.quantization_is_default else None
        elif self.quantization in NO_QUANTIZATION:
            self.quantization = None
        if self.quantization is not None:
            if self.quantization not in QUANTIZATION_METHODS:
                raise ValueError(
                    f"quantization must be one of "
                    f"{', '.join(QUANTIZATION_METHODS + NO_QUANTIZATION)} "
                    f"(or unset), got {self.quantization!r}"
                )
            if self.quantization.startswith("gguf") and self.resolved.format != "gguf":
                raise ValueError(
                    f"quantization {self.quantization!r} runs a GGUF file's own blocks, "
                    f"but {self.model!r} "
                    f"is a {self.resolved.format} model (use 'q8_0')"
                )

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size
