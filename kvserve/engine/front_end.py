"""FrontEnd: the part of an engine that runs beside the caller, whichever engine it is.

LLMEngine (blocking) and AsyncLLM (asyncio) each hold one and differ only in how they
reach the engine core: input processing, the n > 1 fan-out into child requests, output
processing, per-request stats and the stat loggers live here, once.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvserve.config import EngineConfig
from kvserve.engine.input_processor import InputProcessor
from kvserve.engine.output_processor import OutputProcessor, RequestOutputCollector
from kvserve.engine.parallel_sampling import ParentRequest
from kvserve.metrics.loggers import StatLoggerBase
from kvserve.metrics.stats import IterationStats, RequestStatsTracker
from kvserve.protocol.engine_core import EngineCoreRequest, FinishReason, SchedulerStats
from kvserve.transformers_utils.tokenizer import get_tokenizer
from kvserve.utils.census import per_request_objects, prefixed


class FrontEnd:
    # Set by load(), which the engine runs while a background core loads the model.
    tokenizer: Any
    input_processor: InputProcessor
    output_processor: OutputProcessor

    def __init__(
        self, config: EngineConfig, log_stats: bool, stat_loggers: list[StatLoggerBase]
    ) -> None:
        self.config = config
        self.log_stats = log_stats
        self.stat_loggers = stat_loggers
        self.request_stats = RequestStatsTracker()

    def load(self) -> None:
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

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt_text: str | None,
        queue: RequestOutputCollector | None = None,
    ) -> list[EngineCoreRequest]:
        """Registers a processed request for its outputs; returns the engine-core requests
        to send, in order (pass each through input_processor.commit_mm right before its
        send). n > 1: n children with the same prompt, so the prefix cache shares its
        blocks, whose outputs the output processor gathers under the parent's id."""
        params = request.sampling_params  # a pooling request's has n=1
        if params.n == 1:
            self._register(request, prompt_text, None, 0, queue)
            return [request]
        parent = ParentRequest(request.request_id, params)
        children = []
        for index in range(params.n):
            child_id, child_params = parent.get_child_info(index)
            child = msgspec.structs.replace(
                request, request_id=child_id, sampling_params=child_params
            )
            self._register(child, prompt_text, parent, index, queue)
            children.append(child)
        return children

    def _register(
        self,
        request: EngineCoreRequest,
        prompt_text: str | None,
        parent: ParentRequest | None,
        index: int,
        queue: RequestOutputCollector | None,
    ) -> None:
        self.output_processor.add_request(request, prompt_text, parent, index, queue)
        if self.log_stats:
            self.request_stats.add_request(
                request.request_id, request.arrival_time, len(request.prompt_token_ids)
            )

    def request_census(self) -> dict[str, int]:
        """This process's per-request entries and objects (see utils/census.py)."""
        return {
            **prefixed("output_processor", self.output_processor.request_census()),
            **prefixed("request_stats", self.request_stats.request_census()),
            **per_request_objects(),
        }

    def abort(self, request_ids: list[str]) -> list[str]:
        """Forgets the requests (user or child ids); returns the engine-core ids to abort."""
        core_ids = self.output_processor.abort_requests(request_ids)
        if self.log_stats and core_ids:
            stats = IterationStats()
            self.request_stats.finish_requests(core_ids, str(FinishReason.ABORT), stats)
            self.record(None, stats)
        return core_ids

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        engine_idx: int = 0,
    ) -> None:
        for stat_logger in self.stat_loggers:
            stat_logger.record(scheduler_stats, iteration_stats, engine_idx)
