"""Engine configuration: flat dataclasses, each validated in __post_init__."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

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
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass
class ModelConfig:
    model: str | None = DEFAULT_MODEL
    tokenizer: str | None = None
    dtype: str = "float32"
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
        if self.dtype not in ("float32", "float", "auto"):
            raise ValueError(f"dtype must be 'float32' (or 'auto'), got {self.dtype!r}")
        self.dtype = "float32"
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


@dataclass
class CacheConfig:
    block_size: int = 16
    # Bytes for the paged KV cache of all layers together.
    kv_cache_memory: int = 1 * GiB
    enable_prefix_caching: bool = True
    # Seed of the block hash, so every process and machine agrees on block keys.
    prefix_caching_hash_seed: int = 0
    num_blocks_override: int | None = None
    # Element type of the paged KV cache (vLLM's --kv-cache-dtype). "auto" is the model's
    # dtype; float16 / bfloat16 halve the cache's bytes (decode attention at long contexts
    # is bound by reading them) at the cost of rounding the stored keys and values.
    cache_dtype: str = "auto"
    # StreamingLLM (0 = off): full-attention layers keep the first attention_sinks tokens
    # and a window of max_model_len - attention_sinks recent ones, so a sequence may grow
    # past max_model_len, up to sink_max_seq_len (default 8x max_model_len).
    attention_sinks: int = 0
    sink_max_seq_len: int | None = None

    def __post_init__(self) -> None:
        if self.attention_sinks < 0:
            raise ValueError(f"attention_sinks must be >= 0, got {self.attention_sinks}")
        if self.sink_max_seq_len is not None and not self.attention_sinks:
            raise ValueError("sink_max_seq_len needs attention_sinks > 0")
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.cache_dtype!r}"
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive bytes, got {self.kv_cache_memory}")
        if self.num_blocks_override is not None and self.num_blocks_override < 2:
            raise ValueError(
                f"num_blocks_override must be at least 2, got {self.num_blocks_override}"
            )

    def kv_dtype(self, model_dtype: str) -> str:
        """The cache's element type by name ("auto": the model's)."""
        return model_dtype if self.cache_dtype == "auto" else self.cache_dtype


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True
    # A prefill longer than this is chunked even when the budget could take it (0 = off).
    long_prefill_token_threshold: int = 0
    policy: Literal["fcfs", "priority"] = "fcfs"

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")

    def verify_against_model_len(self) -> None:
        """Called once max_model_len is known from the model."""
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_model_len ({self.max_model_len}) when chunked prefill is disabled"
            )


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: Literal["uni", "mp", "ray"] | None = None

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ValueError("tensor_parallel_size and pipeline_parallel_size must be >= 1")
        if self.distributed_executor_backend is None:
            self.distributed_executor_backend = "uni" if self.world_size == 1 else "mp"
        if self.world_size > 1 and self.distributed_executor_backend == "uni":
            raise ValueError(
                f"distributed_executor_backend='uni' runs one worker, but tensor_parallel_size"
                f" x pipeline_parallel_size = {self.world_size}: use 'mp'"
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


def _cuda_available() -> bool:
    """torch.cuda.is_available(), without importing torch (seconds) where the installed
    build has no GPU backend: the front end builds this config before it spawns the
    engine core, and must not pay for torch there."""
    import importlib.util
    import re
    import sys

    spec = importlib.util.find_spec("torch") if "torch" not in sys.modules else None
    if spec is not None and spec.submodule_search_locations:
        try:
            with open(f"{spec.submodule_search_locations[0]}/version.py", encoding="utf-8") as f:
                version = f.read()
        except OSError:
            version = ""
        # A CPU-only build writes `cuda: Optional[str] = None` and the same for hip.
        gpu_free = r"^{}\s*(:[^=]*)?=\s*None\s*$"
        if all(re.search(gpu_free.format(key), version, re.M) for key in ("cuda", "hip")):
            return False
    import torch

    return torch.cuda.is_available()


@dataclass
class DeviceConfig:
    device: str = "auto"

    def __post_init__(self) -> None:
        if self.device == "auto":
            self.device = "cuda" if _cuda_available() else "cpu"
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'auto', got {self.device!r}")


# Frozen (hence hashable): an engine's event stream is fixed once it starts.
@dataclass(frozen=True)
class KVEventsConfig:
    """Publishing KV cache events (BlockStored / BlockRemoved / AllBlocksCleared)."""

    enable_kv_cache_events: bool = False
    # None: "zmq" when events are enabled, else "null".
    publisher: Literal["null", "zmq"] | None = None
    # The PUB socket binds here; subscribers connect. A "*" port binds any free port.
    endpoint: str = "tcp://*:5557"
    # ROUTER socket answering replay requests from the ring buffer; None: no replay.
    replay_endpoint: str | None = None
    # Batches (one per engine step with events) kept for replay.
    buffer_steps: int = 10_000
    # ZMQ send high-water mark of the PUB socket: messages beyond it are dropped by ZMQ.
    hwm: int = 100_000
    # Batches waiting for the publisher thread; beyond it publish() drops (never blocks).
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in ("null", "zmq"):
            raise ValueError(f"kv events publisher must be 'null' or 'zmq', got {self.publisher!r}")
        if not self.endpoint:
            raise ValueError("kv events endpoint must not be empty")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"kv events {name} must be at least 1, got {getattr(self, name)}")

    @classmethod
    def from_cli(cls, value: KVEventsConfig | dict[str, Any] | str) -> KVEventsConfig:
        """A config from itself, a dict, or the JSON text of `--kv-events-config`."""
        if isinstance(value, KVEventsConfig):
            return value
        return _dataclass_from_json(cls, value, "--kv-events-config")


_KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass
class KVTransferConfig:
    """A KV connector: which one, its role, and what to do when loading external KV fails.

    Set from Python (``LLM(kv_transfer_config=...)``) or as the JSON object of
    ``--kv-transfer-config``; both go through ``from_cli``.
    """

    # A registered name (e.g. "SharedStorageConnector") or a class in kv_connector_module_path.
    kv_connector: str | None = None
    # "kv_producer" saves KV, "kv_consumer" loads it, "kv_both" does both.
    kv_role: str = "kv_both"
    # Identifies this engine to its peers; a random id when unset.
    engine_id: str | None = None
    # Connector-specific settings, e.g. {"shared_storage_path": "/tmp/kv"}.
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    # Module that defines kv_connector when it is not a built-in one.
    kv_connector_module_path: str | None = None
    # "recompute" rolls the request back to its first bad block; "fail" ends it with an error.
    kv_load_failure_policy: Literal["recompute", "fail"] = "recompute"

    def __post_init__(self) -> None:
        if self.kv_connector is not None and (
            not isinstance(self.kv_connector, str) or not self.kv_connector
        ):
            raise ValueError(f"kv_connector must be a non-empty string, got {self.kv_connector!r}")
        # vLLM's names; the short forms are accepted too.
        role = self.kv_role if self.kv_role in _KV_ROLES else f"kv_{self.kv_role}"
        if role not in _KV_ROLES:
            raise ValueError(
                f"kv_role must be one of {', '.join(_KV_ROLES)} (or producer/consumer/both), "
                f"got {self.kv_role!r}"
            )
        self.kv_role = role
        if self.kv_load_failure_policy not in ("recompute", "fail"):
            raise ValueError(
                "kv_load_failure_policy must be 'recompute' or 'fail', "
                f"got {self.kv_load_failure_policy!r}"
            )
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError(
                "kv_connector_extra_config must be a dict, "
                f"got {type(self.kv_connector_extra_config).__name__}"
            )
        if self.kv_connector_module_path is not None and not self.kv_connector_module_path:
            raise ValueError("kv_connector_module_path must not be empty")
        if self.engine_id is None:
            import uuid

            self.engine_id = uuid.uuid4().hex

    @property
    def is_kv_transfer_instance(self) -> bool:
        return self.kv_connector is not None

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_connector is not None and self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_connector is not None and self.kv_role in ("kv_consumer", "kv_both")

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        return self.kv_connector_extra_config.get(key, default)

    @classmethod
    def from_cli(cls, value: KVTransferConfig | dict[str, Any] | str) -> KVTransferConfig:
        """A config from itself, a dict, or the JSON text of `--kv-transfer-config`."""
        if isinstance(value, KVTransferConfig):
            return value
        return _dataclass_from_json(cls, value, "--kv-transfer-config")


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``--speculative-config`` keys): a proposer drafts
    ``num_speculative_tokens`` tokens per step and the target verifies them in one forward.

    ``method``: "ngram" (prompt lookup, no model) or "draft_model" (a second model with the
    target's tokenizer). A draft model left unset (or naming the target) is the target's own
    file, usually run with a lossy, faster ``quantization`` such as "gguf_int8".
    """

    method: str | None = None
    num_speculative_tokens: int | None = None
    model: str | None = None
    # ngram: the longest and shortest suffix of the tokens so far looked up earlier on.
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # The draft model's weights (same values as ModelConfig.quantization).
    quantization: str | None = None
    draft_model_config: ModelConfig | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.method is None:
            # vLLM accepts model="ngram" for prompt lookup; any other model is a draft model.
            self.method = "ngram" if self.model in ("ngram", "[ngram]") else "draft_model"
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                f"got {self.method!r}"
            )
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError(
                "speculative_config.num_speculative_tokens must be a positive int, "
                f"got {self.num_speculative_tokens!r}"
            )
        if self.method == "ngram":
            self.model = None
            if self.prompt_lookup_max is None:
                self.prompt_lookup_max = max(5, self.prompt_lookup_min or 0)
            if self.prompt_lookup_min is None:
                self.prompt_lookup_min = min(2, self.prompt_lookup_max)
            if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
                raise ValueError(
                    "speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                    f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
                )

    def resolve_draft_model(self, target: ModelConfig) -> None:
        """Builds the draft's ModelConfig (draft_model only); the target's own file when
        ``model`` is unset, and always the target's tokenizer and context length."""
        if self.method != "draft_model":
            return
        same_file = self.model is None or self.model == target.model
        draft = ModelConfig(
            model=target.model if same_file else self.model,
            max_model_len=None,
            quantization=self.quantization,
        )
        if draft.vocab_size != target.vocab_size:
            raise ValueError(
                f"speculative_config.model {draft.model!r} has a vocabulary of "
                f"{draft.vocab_size} tokens, the target {target.vocab_size}: they must match"
            )
        assert target.max_model_len is not None and draft.max_model_len is not None
        if draft.max_model_len < target.max_model_len:
            raise ValueError(
                f"speculative_config.model {draft.model!r} holds {draft.max_model_len} "
                f"positions, fewer than the target's max_model_len {target.max_model_len}"
            )
        self.draft_model_config = draft

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots past the verified tokens a step may write: a draft model runs ahead by
        the drafts it proposes; ngram writes nothing."""
        assert self.num_speculative_tokens is not None
        return self.num_speculative_tokens if self.method == "draft_model" else 0

    @classmethod
    def from_cli(cls, value: SpeculativeConfig | dict[str, Any] | str) -> SpeculativeConfig:
        """A config from itself, a dict, or the JSON text of `--speculative-config`."""
        if isinstance(value, SpeculativeConfig):
            return value
        return _dataclass_from_json(cls, value, "--speculative-config")


@dataclass
class StructuredOutputsConfig:
    """Grammar-constrained decoding (vLLM's StructuredOutputsConfig)."""

    # xgrammar, guidance (llguidance), or auto: xgrammar unless only llguidance runs a spec.
    backend: str = "auto"


@dataclass
class LoRAConfig:
    """vLLM's LoRA engine arguments: adapters resident at once, and their largest rank."""

    max_loras: int = 1
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be at least 1, got {self.max_lora_rank}")


@dataclass
class ECTransferConfig:
    """The encoder cache connector (vLLM's ECConnector): encoder outputs stored to and
    loaded from a tier shared between engine instances. ``ec_connector``: "disk" (a
    directory, ``ec_storage_path``) or "redis" (``ec_redis_url``)."""

    ec_connector: Literal["disk", "redis"]
    ec_storage_path: str | None = None
    ec_redis_url: str | None = None

    def __post_init__(self) -> None:
        if self.ec_connector == "disk" and not self.ec_storage_path:
            raise ValueError("ec_transfer_config: the disk connector needs ec_storage_path")
        if self.ec_connector == "redis" and not self.ec_redis_url:
            raise ValueError("ec_transfer_config: the redis connector needs ec_redis_url")
        if self.ec_connector not in ("disk", "redis"):
            raise ValueError(
                f"ec_transfer_config: unknown ec_connector {self.ec_connector!r} (disk, redis)"
            )

    @classmethod
    def from_cli(cls, value: dict[str, Any] | str) -> ECTransferConfig:
        return _dataclass_from_json(cls, value, "--ec-transfer-config")


@dataclass
class MultiModalConfig:
    """Multimodal input (vLLM's names). ``limit_mm_per_prompt``: most items per modality
    in one prompt; ``max_image_pixels``: the largest image (width x height) accepted;
    ``mm_processor_cache_gb``: the processor cache (front end and its core mirror);
    ``encoder_cache_size``: embedding tokens the encoder cache holds (0: the larger of
    max_num_batched_tokens and the longest item); ``allowed_local_media_path``: the
    directory ``file://`` image URLs may read; ``allow_remote_media``: fetch http(s)."""

    limit_mm_per_prompt: dict[str, int] = field(default_factory=lambda: {"image": 4})
    max_image_pixels: int = 16_000_000
    mm_processor_cache_gb: float = 1.0
    mm_processor_kwargs: dict[str, Any] | None = None
    encoder_cache_size: int = 0
    allowed_local_media_path: str | None = None
    allow_remote_media: bool = False
    ec_transfer_config: ECTransferConfig | None = None

    def __post_init__(self) -> None:
        for modality, limit in self.limit_mm_per_prompt.items():
            if modality != "image":
                raise ValueError(f"limit_mm_per_prompt: unsupported modality {modality!r}")
            if not isinstance(limit, int) or limit < 0:
                raise ValueError(f"limit_mm_per_prompt: {modality} needs an int >= 0")
        if self.max_image_pixels <= 0:
            raise ValueError("max_image_pixels must be positive")
        if self.mm_processor_cache_gb < 0:
            raise ValueError("mm_processor_cache_gb must be >= 0")

    @property
    def processor_cache_bytes(self) -> int:
        return int(self.mm_processor_cache_gb * GiB)


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    kv_transfer_config: KVTransferConfig | None = None
    kv_events_config: KVEventsConfig | None = None
    structured_outputs_config: StructuredOutputsConfig = field(
        default_factory=StructuredOutputsConfig
    )
    speculative_config: SpeculativeConfig | None = None
    # None: LoRA off (enable_lora=False).
    lora_config: LoRAConfig | None = None
    multimodal_config: MultiModalConfig = field(default_factory=MultiModalConfig)

    def __post_init__(self) -> None:
        if self.speculative_config is not None:
            self.speculative_config.resolve_draft_model(self.model_config)
        context_len = self.model_config.max_model_len
        assert context_len is not None
        if self.parallel_config.pipeline_parallel_size > 1 and self.speculative_config:
            raise ValueError("speculative decoding is not supported with pipeline parallelism")
        if self.parallel_config.world_size > 1 and self.kv_transfer_config is not None:
            # Each rank holds its own heads: stores would need per-rank keys (not yet).
            raise ValueError("kv_transfer_config is not supported with tensor parallelism yet")
        if self.model_config.is_pooling:
            self._configure_pooling(context_len)
        self.scheduler_config.max_model_len = context_len
        self.scheduler_config.verify_against_model_len()
        sinks = self.cache_config.attention_sinks
        if sinks:
            if sinks >= context_len:
                raise ValueError(
                    f"attention_sinks ({sinks}) must be less than max_model_len ({context_len}): "
                    "the rest of the context is the sliding window"
                )
            max_seq_len = self.cache_config.sink_max_seq_len or 8 * context_len
            if max_seq_len < context_len:
                raise ValueError(
                    f"sink_max_seq_len ({max_seq_len}) must be at least max_model_len "
                    f"({context_len})"
                )
            self.cache_config.sink_max_seq_len = max_seq_len
            # The scheduler's and the workers' bound is the whole sequence; the KV each
            # request keeps stays within max_model_len (the sink spec bounds it).
            self.scheduler_config.max_model_len = max_seq_len

    def _configure_pooling(self, context_len: int) -> None:
        """A pooling request's vector needs its whole prompt computed here: cached
        prefix blocks would skip the tokens mean pooling averages, and an encoder's
        (bidirectional) states depend on every token of the prompt at once."""
        self.cache_config.enable_prefix_caching = False
        if self.model_config.is_encoder_only:
            self.scheduler_config.enable_chunked_prefill = False
            sched = self.scheduler_config
            sched.max_num_batched_tokens = max(sched.max_num_batched_tokens, context_len)

    @property
    def max_seq_len(self) -> int:
        """The longest sequence a request may reach (max_model_len unless sinks are on)."""
        return self.scheduler_config.max_model_len

    @property
    def sink_window(self) -> int:
        """The sliding window of full-attention layers in sink mode."""
        assert self.model_config.max_model_len is not None
        return self.model_config.max_model_len - self.cache_config.attention_sinks


_Config = TypeVar("_Config")


def _dataclass_from_json(cls: type[_Config], value: dict[str, Any] | str, flag: str) -> _Config:
    """A config dataclass from a dict or JSON text, with errors that name the flag."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{flag} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, got {value!r}")
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(
            f"{flag}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    try:
        return cls(**value)
    except TypeError as exc:  # a value of the wrong type, e.g. "hwm": "big"
        raise ValueError(f"{flag}: {exc}") from None
