"""EngineArgs: the flat set of user options, turned into a validated EngineConfig."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvserve.args.kv_args import KVArgs, add_kv_cli_args
from kvserve.args.mm_args import MultiModalArgs, add_mm_cli_args
from kvserve.args.parallel_args import ParallelArgs, add_parallel_cli_args
from kvserve.args.vllm_compat import VllmCompatArgs
from kvserve.config import (
    DEFAULT_MODEL,
    KV_CACHE_DTYPES,
    MODEL_DTYPES,
    NO_QUANTIZATION,
    QUANTIZATION_METHODS,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
    dataclass_from_json,
)
from kvserve.config.runtime import ATTENTION_BACKENDS
from kvserve.pooling_params import PoolerConfig
from kvserve.transformers_utils.local_model import locate_model

_SIZE_SUFFIXES = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(value: str | int) -> int:
    """'2G', '512MiB', '1e9' or an int -> bytes."""
    if isinstance(value, int):
        return value
    text = value.strip().lower().removesuffix("ib").removesuffix("b")
    scale = _SIZE_SUFFIXES.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in _SIZE_SUFFIXES else text
    try:
        return int(float(number) * scale)
    except ValueError:
        raise ValueError(f"kv_cache_memory: cannot parse {value!r} as a size in bytes") from None


def _model_registrations() -> tuple[tuple[str, str], ...]:
    from kvserve.model_executor.models.registry import ModelRegistry

    return ModelRegistry.out_of_tree_entries()


@dataclass
class EngineArgs(ParallelArgs, KVArgs, MultiModalArgs, VllmCompatArgs):
    """vLLM's engine arguments: those kvserve gives a meaning here are the fields below;
    the ones it accepts without use come from VllmCompatArgs (docs/vllm_compat.md)."""

    model: str | None = DEFAULT_MODEL
    tokenizer: str | None = None
    served_model_name: str | None = None
    # "auto": float32 on a CPU, bfloat16 on CUDA (config.model.resolve_dtype).
    dtype: str = "auto"
    quantization: str | None = None
    max_model_len: int | None = None
    seed: int = 0
    device: str = "auto"
    # vLLM's --attention-backend (also $KVSERVE_ATTENTION_BACKEND); None: by device.
    attention_backend: str | None = None
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    # Bytes (or "2G") for the KV cache; unset: from gpu_memory_utilization when that is
    # given (CUDA: what the profiled instance leaves of that share of the device's total;
    # CPU: that share of the free host RAM), else CacheConfig's default.
    kv_cache_memory: int | str | None = None
    kv_cache_memory_bytes: int | str | None = None  # vLLM's name for kv_cache_memory
    gpu_memory_utilization: float | None = None
    num_blocks_override: int | None = None
    num_gpu_blocks_override: int | None = None  # vLLM's name for num_blocks_override
    enable_prefix_caching: bool = True
    prefix_caching_hash_seed: int = 0
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    # Schedule step N+1 while step N's forward runs (vLLM's --async-scheduling).
    async_scheduling: bool = False
    disable_cascade_attn: bool = False
    # vLLM's: no tokenizer is loaded; prompts are token ids and outputs carry no text.
    skip_tokenizer_init: bool = False
    # StreamingLLM sink mode (see CacheConfig): sink tokens kept by full-attention layers.
    attention_sinks: int = 0
    sink_max_seq_len: int | None = None
    # Custom logits processors: LogitsProcessor subclasses or "package.module:Class" paths.
    logits_processors: Sequence[str | type] | None = None
    # The grammar library of structured outputs: xgrammar, guidance or auto.
    structured_outputs_backend: str = "auto"
    # A SpeculativeConfig, a dict of its fields, or the JSON text of --speculative-config.
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None
    max_logprobs: int = 20
    # vLLM's: LLM.sleep / wake_up and the server's /sleep, /wake_up and /is_sleeping.
    enable_sleep_mode: bool = False
    # vLLM's LLM passes True; the server (and LLMEngine/AsyncLLM.from_engine_args) reads it.
    disable_log_stats: bool = False
    # Prometheus series are named "<prefix>:<name>"; "vllm" gives vLLM's exact names.
    metrics_prefix: str = "kvserve"
    # Loading local files (kvserve does not download): see transformers_utils.local_model.
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    load_format: str = "auto"
    # Default sampling parameters: "auto" (the model's generation config), "vllm" or a folder.
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] | str | None = None

    def _explicit_kv_cache_bytes(self) -> int | str | None:
        given = self.kv_cache_memory
        return self.kv_cache_memory_bytes if given is None else given

    def _profiled_utilization(self, device: str) -> float | None:
        """gpu_memory_utilization where the worker sizes the KV cache from a profile (CUDA,
        no explicit size); elsewhere it is a share of the free memory (_kv_cache_bytes)."""
        if device != "cuda" or self._explicit_kv_cache_bytes() is not None:
            return None
        return self.gpu_memory_utilization

    def _kv_cache_bytes(self, device: str) -> int:
        given = self._explicit_kv_cache_bytes()
        if given is not None:
            return parse_bytes(given)
        if self.gpu_memory_utilization is not None and device != "cuda":
            from kvserve.utils.memory import kv_cache_bytes_for_utilization

            return kv_cache_bytes_for_utilization(self.gpu_memory_utilization, device)
        return CacheConfig.kv_cache_memory

    def _generation_overrides(self) -> dict[str, Any] | None:
        value = self.override_generation_config
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"override_generation_config is not valid JSON: {exc}") from None
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"override_generation_config must be a dict, got {value!r}")
        return value

    # Pooling models (vLLM's names): runner "pooling" or task "embed" returns vectors;
    # pooler_config is a PoolerConfig, a dict of its fields or JSON text.
    runner: str = "auto"
    task: str | None = None
    pooler_config: PoolerConfig | dict[str, Any] | str | None = None
    # LoRA adapters (vLLM's names): off unless enable_lora.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16

    def _pooler_config(self) -> PoolerConfig | None:
        value = self.pooler_config
        if value is None or isinstance(value, PoolerConfig):
            return value
        return dataclass_from_json(PoolerConfig, value, "pooler_config")

    def _logits_processors(self) -> tuple[str | type, ...]:
        specs = tuple(self.logits_processors or ())
        if specs:
            # Loaded here once so that a wrong name fails now, naming the field, rather
            # than in the engine core; imported here since it brings torch along.
            from kvserve.sample.logits_processor.loader import load_logits_processors

            load_logits_processors(specs)
        return specs

    def create_engine_config(self) -> EngineConfig:
        device_config = DeviceConfig(device=self.device, attention_backend=self.attention_backend)
        self.check_ignored_args(device_config.device)
        model = locate_model(self.model, self.revision, self.download_dir)
        model_config = ModelConfig(
            model=model,
            tokenizer=locate_model(self.tokenizer, self.tokenizer_revision, self.download_dir),
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            seed=self.seed,
            # A model found in download_dir keeps the name it was asked for (org/name).
            served_model_name=self.served_model_name
            or (None if model == self.model else self.model),
            quantization=self.quantization,
            disable_cascade_attn=self.disable_cascade_attn,
            skip_tokenizer_init=self.skip_tokenizer_init,
            model_registrations=_model_registrations(),
            logits_processors=self._logits_processors(),
            max_logprobs=self.max_logprobs,
            enable_sleep_mode=self.enable_sleep_mode,
            generation_config=self.generation_config,
            override_generation_config=self._generation_overrides(),
            load_format=self.load_format,
            runner=self.runner,
            task=self.task,
            pooler_config=self._pooler_config(),
        )
        assert model_config.max_model_len is not None
        # A model without a class fails here, listing what is supported (no torch import).
        from kvserve.model_executor.models.registry import ModelRegistry

        ModelRegistry.check_supported(model_config.arch.architecture)
        return EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                cache_dtype=self.kv_cache_dtype,
                kv_cache_memory=self._kv_cache_bytes(device_config.device),
                gpu_memory_utilization=self._profiled_utilization(device_config.device),
                enable_prefix_caching=self.enable_prefix_caching,
                prefix_caching_hash_seed=self.prefix_caching_hash_seed,
                num_blocks_override=self.num_blocks_override or self.num_gpu_blocks_override,
                attention_sinks=self.attention_sinks,
                sink_max_seq_len=self.sink_max_seq_len,
            ),
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_num_seqs=self.max_num_seqs,
                max_model_len=model_config.max_model_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                policy=self.scheduling_policy,
                async_scheduling=self.async_scheduling,
            ),
            parallel_config=self._parallel_config(),
            device_config=device_config,
            kv_events_config=self._events_config(),
            kv_transfer_config=self._transfer_config(),
            kv_security_config=self._security_config(),
            structured_outputs_config=self._structured_outputs_config(),
            speculative_config=(
                None
                if self.speculative_config is None
                else SpeculativeConfig.from_cli(self.speculative_config)
            ),
            lora_config=(
                LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank)
                if self.enable_lora
                else None
            ),
            multimodal_config=self._multimodal_config(),
            metrics_prefix=self.metrics_prefix,
            compilation_config=self.cuda_graph_config(),
        )

    def _structured_outputs_config(self) -> StructuredOutputsConfig:
        # Imported here: the registry brings the grammar libraries along.
        from kvserve.structured_output.backend_types import backend_names

        if self.structured_outputs_backend not in backend_names():
            raise ValueError(
                f"structured_outputs_backend must be one of {', '.join(backend_names())}, "
                f"got {self.structured_outputs_backend!r}"
            )
        return StructuredOutputsConfig(backend=self.structured_outputs_backend)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(**kwargs)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, with_model: bool = True) -> None:
        """vLLM's flag names, where they apply."""
        if with_model:
            parser.add_argument(
                "model",
                nargs="?",
                default=DEFAULT_MODEL,
                help="GGUF file, HF directory or a known name",
            )
        parser.add_argument("--tokenizer", default=None)
        parser.add_argument(
            "--skip-tokenizer-init", action="store_true",
            help="load no tokenizer (a checkpoint without one runs): prompts are token ids, "
            "outputs carry token ids and no text",
        )  # fmt: skip
        parser.add_argument("--served-model-name", default=None)
        parser.add_argument("--max-model-len", type=int, default=None)
        parser.add_argument(
            "--quantization", "-q", default=None,
            choices=[*QUANTIZATION_METHODS, *NO_QUANTIZATION],
            help="gguf (default for GGUF models): run the file's Q4_1/Q8_0/Q4_0 blocks "
            "directly, lossless; gguf_int8: the same blocks with int8 activations, as "
            "llama.cpp (faster, lossy); q8_0: quantize float weights to Q8_0 blocks; "
            "none/float32 (default for HF directories): dequantize to float32 at load",
        )  # fmt: skip
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument(
            "--dtype", default="auto", choices=[*MODEL_DTYPES, "float", "half"],
            help="weights' and activations' type; auto: float32 on a CPU (its only type), "
            "bfloat16 on CUDA (GGUF blocks dequantize losslessly to float32, then cast)",
        )  # fmt: skip
        parser.add_argument(
            "--prefix-caching-hash-seed", type=int, default=0,
            help="seed of the block hash; every engine sharing a KV store must use the same",
        )  # fmt: skip
        parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
        parser.add_argument(
            "--attention-backend", default=None, choices=list(ATTENTION_BACKENDS),
            help="force one (default: FLASH_ATTN, else TRITON on CUDA; CPU_ATTN on a CPU)",
        )  # fmt: skip
        parser.add_argument("--block-size", type=int, default=16)
        parser.add_argument(
            "--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
            help="element type of the KV cache; auto: the model's (float32). float16 or "
            "bfloat16 halve the bytes decode attention reads, rounding stored keys/values; "
            "int8 (and vLLM's fp8 names, the same int8 cache) quarter them, each key/value "
            "row quantized with its own scale",
        )  # fmt: skip
        parser.add_argument(
            "--kv-cache-memory", "--kv-cache-memory-bytes", default=None,
            help="bytes for the paged KV cache, e.g. 2G (default: --gpu-memory-utilization's "
            f"share of the available memory if given, else {CacheConfig.kv_cache_memory >> 20}M)",
        )  # fmt: skip
        parser.add_argument(
            "--gpu-memory-utilization", type=float, default=None,
            help="without --kv-cache-memory: on CUDA the share of the GPU's total memory this "
            "instance may use (weights, activations and CUDA graphs are profiled, the KV cache "
            "gets the rest); on the CPU the KV cache takes this share of the free host RAM",
        )  # fmt: skip
        parser.add_argument(
            "--num-gpu-blocks-override", "--num-blocks-override", dest="num_blocks_override",
            type=int, default=None, help="this many KV blocks, whatever the memory size",
        )  # fmt: skip
        parser.add_argument(
            "--max-logprobs", type=int, default=20,
            help="most logprobs / prompt_logprobs a request may ask for (-1: no limit)",
        )  # fmt: skip
        parser.add_argument(
            "--enable-sleep-mode", action="store_true",
            help="let the engine sleep (free its KV cache, and its weights at level 2) and "
            "wake up: the server's /sleep, /wake_up and /is_sleeping routes",
        )  # fmt: skip
        parser.add_argument(
            "--disable-log-stats", action="store_true", help="do not log engine statistics"
        )
        parser.add_argument(
            "--metrics-prefix", default="kvserve",
            help='name the Prometheus series "<prefix>:<name>"; "vllm" gives the names vLLM\'s '
            "Grafana dashboard and vLLM-aware routers read (vllm:num_requests_waiting, ...)",
        )  # fmt: skip
        parser.add_argument(
            "--revision", default=None,
            help="snapshot of a model in the Hugging Face cache layout (local files only)",
        )  # fmt: skip
        parser.add_argument("--tokenizer-revision", default=None)
        parser.add_argument(
            "--download-dir", default=None,
            help="folder holding the model (plain or in the HF cache layout); nothing is "
            "downloaded",
        )  # fmt: skip
        parser.add_argument(
            "--load-format", default="auto", choices=["auto", "safetensors", "gguf", "pt",
                                                      "npcache", "dummy"],
            help="auto, safetensors or gguf (pt/npcache/dummy are refused: no pickles)",
        )  # fmt: skip
        parser.add_argument(
            "--generation-config", default="auto",
            help="default sampling parameters: auto (the model's generation config), vllm "
            "(none), or a folder with a generation_config.json",
        )  # fmt: skip
        parser.add_argument(
            "--override-generation-config", default=None,
            help='JSON, e.g. \'{"temperature": 0.5}\', applied over the generation config',
        )  # fmt: skip
        parser.add_argument(
            "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True
        )
        parser.add_argument(
            "--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens
        )
        parser.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs)
        parser.add_argument(
            "--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True
        )
        parser.add_argument("--long-prefill-token-threshold", type=int, default=0)
        parser.add_argument(
            "--disable-cascade-attn", action="store_true",
            help="attend to a prefix shared by many running requests once per request, "
            "not once for all of them (cascade attention is on by default, cost rule "
            "permitting)",
        )  # fmt: skip
        parser.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
        parser.add_argument(
            "--async-scheduling", action=argparse.BooleanOptionalAction,
            default=EngineArgs.async_scheduling,
            help="schedule and prepare step N+1 and process step N's outputs while step N's "
            "forward runs (one worker in the engine process; other setups run synchronously)",
        )  # fmt: skip
        parser.add_argument(
            "--attention-sinks", type=int, default=0,
            help="StreamingLLM: full-attention layers keep this many first tokens plus a "
            "window of max_model_len minus them, so generation can run past max_model_len",
        )  # fmt: skip
        parser.add_argument(
            "--sink-max-seq-len", type=int, default=None,
            help="with --attention-sinks: the longest sequence (default 8x max_model_len)",
        )  # fmt: skip
        parser.add_argument(
            "--speculative-config",
            default=None,
            help='speculative decoding as JSON, e.g. \'{"method": "ngram", '
            '"num_speculative_tokens": 4, "prompt_lookup_max": 5}\', \'{"method": "suffix"}\' or '
            '\'{"method": "draft_model", "num_speculative_tokens": 3, "quantization": '
            '"gguf_int8"}\'',
        )

        parser.add_argument(
            "--structured-outputs-backend", default="auto",
            help="grammar library for response_format / structured_outputs / tool calls: "
            "xgrammar, guidance (llguidance), or auto (xgrammar unless only guidance can "
            "run the spec)",
        )  # fmt: skip
        parser.add_argument(
            "--logits-processors",
            nargs="+",
            default=None,
            metavar="MODULE:CLASS",
            help="custom LogitsProcessor classes to load, run in every batch after the "
            "built-ins; requests turn them on through SamplingParams.extra_args",
        )
        VllmCompatArgs.add_ignored_cli_args(parser)
        parser.add_argument(
            "--runner", default="auto", choices=["auto", "generate", "pooling"],
            help="pooling: return one vector per prompt (/v1/embeddings) instead of tokens",
        )  # fmt: skip
        parser.add_argument(
            "--task", default=None, choices=["generate", "embed", "encode"],
            help="vLLM's task: embed or encode selects the pooling runner",
        )  # fmt: skip
        parser.add_argument(
            "--pooler-config", default=None,
            help='the pooler as JSON, e.g. \'{"pooling_type": "MEAN", "normalize": true}\'',
        )  # fmt: skip
        parser.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters")
        parser.add_argument("--max-loras", type=int, default=1, help="adapters in one batch")
        parser.add_argument("--max-lora-rank", type=int, default=16)
        add_parallel_cli_args(parser)
        add_kv_cli_args(parser)
        add_mm_cli_args(parser)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        values = {
            f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)
        }
        return cls(**values)
