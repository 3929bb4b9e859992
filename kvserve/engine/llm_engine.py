"""LLMEngine: the synchronous engine behind LLM — inputs in, RequestOutputs out, step by step."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry

from kvserve.config import EngineConfig
from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.core_client import EngineCoreClient, InprocClient
from kvserve.engine.input_processor import InputProcessor
from kvserve.engine.output_processor import OutputProcessor
from kvserve.engine.parallel_sampling import ParentRequest
from kvserve.inputs import PromptType
from kvserve.lora.request import LoRARequest
from kvserve.metrics.loggers import PrometheusStatLogger
from kvserve.metrics.reader import Metric, get_metrics_snapshot
from kvserve.metrics.stats import RequestStatsTracker
from kvserve.outputs import AnyRequestOutput
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import SamplingParams
from kvserve.transformers_utils.tokenizer import get_tokenizer

logger = logging.getLogger(__name__)


class LLMEngine:
    # Set by _init_front_end (while a background core process loads the model).
    tokenizer: Any
    input_processor: InputProcessor
    output_processor: OutputProcessor

    def __init__(
        self, config: EngineConfig, log_stats: bool = False, multiprocess_mode: bool = False
    ) -> None:
        self.config = config
        self.log_stats = log_stats
        # With log_stats, vLLM's metrics in a registry of this engine's own (get_metrics).
        self.stat_logger: PrometheusStatLogger | None = None
        self.request_stats = RequestStatsTracker()
        if log_stats:
            self.stat_logger = PrometheusStatLogger(
                config.model_config.served_model_name or "model", registry=CollectorRegistry()
            )
        # The core runs in this thread, or in its own process behind ZMQ.
        self.engine_core = EngineCoreClient.make_client(
            config,
            log_stats=log_stats,
            multiprocess_mode=multiprocess_mode,
            while_starting=self._init_front_end,
        )

    def _init_front_end(self) -> None:
        config = self.config
        mc = config.model_config
        self.tokenizer = None if mc.skip_tokenizer_init else get_tokenizer(mc.tokenizer_resolved)
        self.input_processor = InputProcessor(
            config.model_config,
            self.tokenizer,
            config.scheduler_config,
            config.structured_outputs_config.backend,
            config.lora_config,
            config.multimodal_config,
        )
        self.output_processor = OutputProcessor(self.tokenizer, log_stats=self.log_stats)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs: Any) -> LLMEngine:
        kwargs.setdefault("log_stats", not engine_args.disable_log_stats)
        return cls(engine_args.create_engine_config(), **kwargs)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validates and queues one request; raises ValueError on bad input, adding nothing."""
        arrival_time = arrival_time if arrival_time is not None else time.time()
        request, prompt_text = self.input_processor.process_inputs(
            request_id,
            prompt,
            params,
            arrival_time=arrival_time,
            priority=priority,
            cache_salt=cache_salt,
            lora_request=lora_request,
        )
        n = params.n if isinstance(params, SamplingParams) else 1
        if self.log_stats:
            for index in range(n):
                child_id = request_id if n == 1 else f"{index}_{request_id}"
                self.request_stats.add_request(
                    child_id, arrival_time, len(request.prompt_token_ids)
                )
        if not isinstance(params, SamplingParams) or n == 1:
            self.output_processor.add_request(request, prompt_text)
            self.engine_core.add_request(self.input_processor.commit_mm(request))
            return
        # n > 1: n child requests with the same prompt, so the prefix cache shares its blocks.
        parent = ParentRequest(request_id, request.sampling_params)
        for index in range(params.n):
            child_id, child_params = parent.get_child_info(index)
            child = msgspec.structs.replace(
                request, request_id=child_id, sampling_params=child_params
            )
            self.output_processor.add_request(child, prompt_text, parent, index)
            self.engine_core.add_request(self.input_processor.commit_mm(child))

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        all_ids = self.output_processor.abort_requests(ids)
        self.engine_core.abort_requests(list(all_ids) if all_ids is not None else ids)

    def step(self) -> list[AnyRequestOutput]:
        core_outputs = self.engine_core.get_output()
        if self.stat_logger is not None:
            self.stat_logger.record(
                core_outputs.scheduler_stats,
                self.request_stats.make_iteration_stats(core_outputs.outputs),
            )
        processed = self.output_processor.process_outputs(
            core_outputs.outputs, core_outputs.timestamp
        )
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def get_metrics(self) -> list[Metric]:
        """vLLM's metrics reader: a snapshot of this engine's metrics (needs log_stats)."""
        if self.stat_logger is None:
            raise RuntimeError("stat logging is off: create the LLM with disable_log_stats=False")
        return get_metrics_snapshot(self.stat_logger.registry)

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        if not isinstance(self.engine_core, InprocClient):
            # A callable and arbitrary arguments reach another process only as pickles,
            # which kvserve never sends; the in-process core calls the worker directly.
            raise ValueError(
                "collective_rpc needs the engine core in this process "
                "(LLM(..., multiprocess_mode=False), the default)"
            )
        return list(self.engine_core.collective_rpc(method, timeout, args, kwargs))

    def shutdown(self) -> None:
        self.engine_core.shutdown()
