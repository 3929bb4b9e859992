"""The whole engine configuration, checked across its parts (EngineConfig)."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

from kvserve.config.compilation import CompilationConfig
from kvserve.config.features import LoRAConfig, SpeculativeConfig, StructuredOutputsConfig
from kvserve.config.kv_quant import configure_quantized_kv_cache
from kvserve.config.kv_transfer import KVEventsConfig, KVSecurityConfig, KVTransferConfig
from kvserve.config.model import INT8_KV_SCALE_BYTES, ModelConfig, resolve_dtype
from kvserve.config.multimodal import MultiModalConfig
from kvserve.config.runtime import CacheConfig, DeviceConfig, ParallelConfig, SchedulerConfig

logger = logging.getLogger(__name__)
_DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    kv_transfer_config: KVTransferConfig | None = None
    kv_events_config: KVEventsConfig | None = None
    kv_security_config: KVSecurityConfig = field(default_factory=KVSecurityConfig)
    structured_outputs_config: StructuredOutputsConfig = field(
        default_factory=StructuredOutputsConfig
    )
    speculative_config: SpeculativeConfig | None = None
    # None: LoRA off (enable_lora=False).
    lora_config: LoRAConfig | None = None
    multimodal_config: MultiModalConfig = field(default_factory=MultiModalConfig)
    # Prometheus series names: "<metrics_prefix>:<name>".
    metrics_prefix: str = "kvserve"
    # CUDA graphs for decode steps (vLLM's names); capture sizes resolved here.
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)

    def __post_init__(self) -> None:
        self.model_config.dtype = resolve_dtype(self.model_config.dtype, self.device_config.device)
        sched = self.scheduler_config
        self.compilation_config.resolve(sched.max_num_seqs, sched.max_num_batched_tokens)
        if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", self.metrics_prefix):
            raise ValueError(
                f"metrics_prefix must be a Prometheus name (letters, digits, _), got "
                f"{self.metrics_prefix!r}"
            )
        if self.parallel_config.data_parallel_size > 1:
            # The processor cache's core side mirrors the front end's in the order of its
            # requests; with several cores, each sees only its own: no mirror can follow.
            self.multimodal_config.mm_processor_cache_gb = 0
        if self.speculative_config is not None:
            self.speculative_config.resolve_draft_model(self.model_config)
        context_len = self.model_config.max_model_len
        assert context_len is not None
        if self.parallel_config.pipeline_parallel_size > 1 and self.speculative_config:
            raise ValueError("speculative decoding is not supported with pipeline parallelism")
        if self.model_config.is_pooling:
            self._configure_pooling(context_len)
        if self.cache_config.kv_dtype(self.model_config.dtype) == "int8":
            configure_quantized_kv_cache(self)
        if self.model_config.arch.mamba is not None:
            self._configure_mamba()
        mm_arch = self.model_config.arch.multimodal
        if mm_arch is not None and mm_arch.encoder_decoder:
            # The decoder's KV depends on the audio through cross-attention, which the
            # token hashes do not see (vLLM turns prefix caching off for these models
            # too); the encoder's K/V are shared by the encoder input's hash instead.
            self.cache_config.enable_prefix_caching = False
        self.scheduler_config.max_model_len = context_len
        self.scheduler_config.verify_against_model_len()
        if self.scheduler_config.async_scheduling:
            self._configure_async_scheduling()
        if self.parallel_config.enable_dbo:
            self._check_dbo()
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

    def _configure_mamba(self) -> None:
        """Mamba layers keep one state block per request in the pool the attention layers
        share (vLLM's hybrid allocator): an attention page must be at least a state, so
        the block size doubles until it is (the state is padded up to the page)."""
        arch, cache = self.model_config.arch, self.cache_config
        assert arch.mamba is not None
        # Feed-forward-only layers (NemotronH's "mlp") hold no cache.
        if any(kind not in ("mamba", "mlp") for kind in arch.layer_types):
            kv_dtype = cache.kv_dtype(self.model_config.dtype)
            row = arch.head_dim * _DTYPE_SIZES[kv_dtype]
            row += INT8_KV_SCALE_BYTES if kv_dtype == "int8" else 0  # each row's scale
            per_token = 2 * arch.num_key_value_heads * row
            block_size = cache.block_size
            while block_size * per_token < arch.mamba.state_bytes:
                block_size *= 2
            if block_size != cache.block_size:
                logger.info(
                    "Mamba hybrid: block_size %d -> %d so an attention page (%d bytes) holds "
                    "a Mamba state (%d bytes)",
                    cache.block_size,
                    block_size,
                    block_size * per_token,
                    arch.mamba.state_bytes,
                )
                cache.block_size = block_size
        if self.kv_transfer_config is not None:
            # Connectors move attention pages by token blocks; a state block is not one.
            raise ValueError("kv_transfer_config: KV connectors do not move Mamba states yet")
        spec = self.speculative_config
        if spec is not None and (
            spec.method != "ngram" or (cache.enable_prefix_caching and
                                       (spec.num_speculative_tokens or 0) >= cache.block_size)
        ):  # fmt: skip
            # A draft model would need its own states; drafts spanning more than two
            # blocks would land in entries align mode leaves null.
            raise ValueError(
                "speculative_config: Mamba models take method 'ngram' with "
                f"num_speculative_tokens < block_size ({cache.block_size})"
            )
        if cache.enable_prefix_caching:
            logger.info(
                "prefix caching with Mamba layers: states are cached at block ends "
                "(every %d tokens, core/mamba_manager.py)",
                cache.block_size,
            )

    def _check_dbo(self) -> None:
        """Micro-batches cut a step's tokens in two: features whose per-step state spans
        the whole batch (drafts, adapters' token map, a connector's layer-by-layer
        transfers, Mamba states, image embeddings merged by position) are not cut."""
        arch = self.model_config.arch
        reason = (
            "speculative_config" if self.speculative_config is not None
            else "enable_lora" if self.lora_config is not None
            else "kv_transfer_config" if self.kv_transfer_config is not None
            else "Mamba layers" if arch.mamba is not None
            else "a multimodal model" if arch.multimodal is not None
            else None
        )  # fmt: skip
        if reason is not None:
            raise ValueError(f"enable_dbo does not run with {reason}")

    def _configure_async_scheduling(self) -> None:
        """Async scheduling overlaps one worker thread in this process with the engine
        core (executor/uniproc_executor.py). Where a step's next one needs more than its
        sampled token, it falls back to synchronous steps, and says so: drafts
        (speculative decoding) are proposed from the step's output, a KV connector's saves
        and loads follow each step's metadata, a pooling request ends with its prompt;
        Mamba states have not been checked with it."""
        reason = None
        if self.parallel_config.distributed_executor_backend != "uni":
            reason = "workers in other processes (distributed_executor_backend != 'uni')"
        elif self.speculative_config is not None:
            reason = "speculative decoding (drafts come from each step's output)"
        elif self.kv_transfer_config is not None:
            reason = "a KV connector (kv_transfer_config)"
        elif self.model_config.is_pooling:
            reason = "a pooling model"
        elif "mamba" in self.model_config.arch.layer_types:
            reason = "Mamba layers (their states and caching are not checked with it)"
        if reason is not None:
            logger.warning(
                "async scheduling is not supported with %s: steps run synchronously", reason
            )
            self.scheduler_config.async_scheduling = False

    @property
    def max_seq_len(self) -> int:
        """The longest sequence a request may reach (max_model_len unless sinks are on)."""
        return self.scheduler_config.max_model_len

    @property
    def sink_window(self) -> int:
        """The sliding window of full-attention layers in sink mode."""
        assert self.model_config.max_model_len is not None
        return self.model_config.max_model_len - self.cache_config.attention_sinks
