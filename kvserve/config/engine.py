"""The whole engine configuration, checked across its parts (EngineConfig)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from kvserve.config.features import LoRAConfig, SpeculativeConfig, StructuredOutputsConfig
from kvserve.config.kv_transfer import KVEventsConfig, KVSecurityConfig, KVTransferConfig
from kvserve.config.model import ModelConfig
from kvserve.config.multimodal import MultiModalConfig
from kvserve.config.runtime import CacheConfig, DeviceConfig, ParallelConfig, SchedulerConfig


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

    def __post_init__(self) -> None:
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
        mm_arch = self.model_config.arch.multimodal
        if mm_arch is not None and mm_arch.encoder_decoder:
            # The decoder's KV depends on the audio through cross-attention, which the
            # token hashes do not see (vLLM turns prefix caching off for these models
            # too); the encoder's K/V are shared by the encoder input's hash instead.
            self.cache_config.enable_prefix_caching = False
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
