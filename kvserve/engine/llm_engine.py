"""LLMEngine: the synchronous engine behind LLM — inputs in, RequestOutputs out, step by step."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry

from kvserve.args.engine_args import EngineArgs
from kvserve.config import EngineConfig
from kvserve.engine.core_client import EngineCoreClient
from kvserve.engine.exceptions import EngineBusyError, EngineSleepingError
from kvserve.engine.front_end import FrontEnd
from kvserve.engine.input_processor import InputProcessor
from kvserve.engine.output_processor import OutputProcessor
from kvserve.inputs import PromptType
from kvserve.lora.request import LoRARequest
from kvserve.metrics.loggers import PrometheusStatLogger
from kvserve.metrics.reader import Metric, get_metrics_snapshot
from kvserve.outputs import AnyRequestOutput
from kvserve.pooling_params import PoolingParams
from kvserve.protocol.sleep_mode import check_sleep_level, check_wake_tags
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self, config: EngineConfig, log_stats: bool = False, multiprocess_mode: bool = False
    ) -> None:
        self.config = config
        self.log_stats = log_stats
        # With log_stats, vLLM's metrics in a registry of this engine's own (get_metrics).
        self.stat_logger: PrometheusStatLogger | None = None
        if log_stats:
            self.stat_logger = PrometheusStatLogger(
                config.model_config.served_model_name or "model",
                registry=CollectorRegistry(),
                prefix=config.metrics_prefix,
            )
        self.front_end = FrontEnd(config, log_stats, [self.stat_logger] if self.stat_logger else [])
        # The core runs in this thread, or in its own process behind ZMQ.
        self.engine_core = EngineCoreClient.make_client(
            config,
            log_stats=log_stats,
            multiprocess_mode=multiprocess_mode,
            while_starting=self.front_end.load,
        )
        # The front end's parts, loaded by now, under the names vLLM's engines use.
        self.tokenizer: Any = self.front_end.tokenizer
        self.input_processor: InputProcessor = self.front_end.input_processor
        self.output_processor: OutputProcessor = self.front_end.output_processor
        # Sleep mode: the core's sleeping state as its last reply left it.
        self._sleeping = False

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
        """Validates and queues one request; raises ValueError on bad input, adding nothing
        (EngineSleepingError while the engine sleeps)."""
        if self._sleeping:
            raise EngineSleepingError()
        request, prompt_text = self.input_processor.process_inputs(
            request_id,
            prompt,
            params,
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            priority=priority,
            cache_salt=cache_salt,
            lora_request=lora_request,
        )
        core_requests = self.front_end.add_request(request, prompt_text)
        self.engine_core.add_requests([self.input_processor.commit_mm(r) for r in core_requests])

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.engine_core.abort_requests(self.front_end.abort(ids))

    def step(self) -> list[AnyRequestOutput]:
        core_outputs = self.engine_core.get_output()
        if self.log_stats:
            self.front_end.record(
                core_outputs.scheduler_stats,
                self.front_end.request_stats.make_iteration_stats(
                    core_outputs.outputs, core_outputs.scheduled_times
                ),
                core_outputs.engine_index,
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

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode (enable_sleep_mode): frees the KV cache, and the weights at
        level 2, keeping the process; generation waits for wake_up. Needs an idle engine."""
        if not self.config.model_config.enable_sleep_mode:
            raise ValueError("sleep mode is off: create the engine with enable_sleep_mode=True")
        check_sleep_level(level)
        if self.has_unfinished_requests():
            raise EngineBusyError(
                f"cannot sleep with {self.get_num_unfinished_requests()} unfinished request(s)"
            )
        self._sleeping = self.engine_core.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Gives back what sleep freed: all of it, or the tags' ("weights", "kv_cache")."""
        self._sleeping = self.engine_core.wake_up(check_wake_tags(tags))

    def is_sleeping(self) -> bool:
        return self.engine_core.is_sleeping()

    def request_census(self) -> dict[str, dict[str, int]]:
        """Per process, what every owner of per-request state still holds (all 0 once
        every request has ended; see utils/census.py). A core in this process shares its
        object counts with the front end's, so they are reported once, by the core."""
        core = self.engine_core.request_census()
        front = self.front_end.request_census()
        if self.engine_core.runs_core_in_process:
            front = {k: v for k, v in front.items() if not k.startswith("objects.")}
        return {"front_end": front, **core}

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        executor = self.engine_core.in_process_executor()
        return list(executor.collective_rpc(method, timeout, args, kwargs))

    def shutdown(self) -> None:
        self.engine_core.shutdown()
