"""AsyncLLM: the asyncio engine behind the server, with the EngineCore in its own process.

Input processing (tokenize, validate) and output processing (detokenize, stop strings)
run here in the front end; the busy loop runs in EngineCoreProc. One background task
pulls EngineCoreOutputs, turns them into RequestOutputs and hands each to its request's
RequestOutputCollector, which the request's generate() iterator awaits.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncGenerator, Iterable
from typing import Any

from kvserve.args.engine_args import EngineArgs
from kvserve.config import EngineConfig
from kvserve.engine.async_mp_client import AsyncMPClient
from kvserve.engine.core_client import AsyncEngineCoreClient
from kvserve.engine.dp_async_client import DPAsyncClient
from kvserve.engine.engine_client import EngineClient
from kvserve.engine.exceptions import EngineBusyError, EngineDeadError, EngineSleepingError
from kvserve.engine.front_end import FrontEnd
from kvserve.engine.input_processor import InputProcessor
from kvserve.engine.output_processor import OutputProcessor, RequestOutputCollector
from kvserve.inputs import PromptType
from kvserve.lora.request import LoRARequest
from kvserve.metrics.loggers import LoggingStatLogger, PrometheusStatLogger, StatLoggerBase
from kvserve.outputs import AnyRequestOutput, PoolingRequestOutput, RequestOutput
from kvserve.pooling_params import PoolingParams
from kvserve.protocol.engine_core import (
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)
from kvserve.protocol.sleep_mode import check_sleep_level, check_wake_tags
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

STATS_LOG_INTERVAL_S = 5.0


class AsyncLLM(EngineClient):
    def __init__(
        self,
        config: EngineConfig,
        log_stats: bool = True,
        stat_loggers: list[StatLoggerBase] | None = None,
        **client_kwargs: Any,
    ) -> None:
        """Starts the engine-core process; raises its startup error (e.g. ValueError)."""
        self.config = config
        self.model_config = config.model_config
        self.log_stats = log_stats
        if stat_loggers is None:
            stat_loggers = (
                []
                if not log_stats
                else [
                    LoggingStatLogger(),
                    PrometheusStatLogger(
                        config.model_config.served_model_name or "model",
                        prefix=config.metrics_prefix,
                    ),
                ]
            )
        self.front_end = FrontEnd(config, log_stats, stat_loggers)
        # The tokenizer loads here while the core process(es) load the model.
        self.engine_core: AsyncEngineCoreClient = (
            DPAsyncClient(config, log_stats, while_starting=self.front_end.load, **client_kwargs)
            if config.parallel_config.front_end_balances
            else AsyncMPClient(
                config, log_stats, while_starting=self.front_end.load, **client_kwargs
            )
        )
        # The front end's parts, loaded by now, under the names vLLM's engines use.
        self.tokenizer: Any = self.front_end.tokenizer
        self.input_processor: InputProcessor = self.front_end.input_processor
        self.output_processor: OutputProcessor = self.front_end.output_processor
        self._dead_error: EngineDeadError | None = None
        self._closed = False
        self._output_handler: asyncio.Task[None] | None = None
        self._stats_logger_task: asyncio.Task[None] | None = None
        # Orders the sends of requests with images (the processor cache's protocol).
        self._mm_send_lock = asyncio.Lock()
        # Sleep mode: the core's sleeping state as its last reply left it, so that a
        # request is refused here at once instead of failing in the core.
        self._sleeping = False

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs: Any) -> AsyncLLM:
        kwargs.setdefault("log_stats", not engine_args.disable_log_stats)
        return cls(engine_args.create_engine_config(), **kwargs)

    # --- state -------------------------------------------------------------------------

    @property
    def errored(self) -> bool:
        return self._dead_error is not None or not self.engine_core.is_alive()

    @property
    def is_running(self) -> bool:
        return not self._closed and not self.errored

    @property
    def dead_error(self) -> BaseException:
        return self._dead_error or EngineDeadError(self.engine_core.dead_reason)

    async def check_health(self) -> None:
        if self.errored:
            raise self.dead_error

    # --- requests ----------------------------------------------------------------------

    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestOutputCollector:
        """Validates (ValueError) and submits one request; its outputs arrive in the queue."""
        if self.errored:
            raise self.dead_error
        if self._sleeping:
            raise EngineSleepingError()
        self._ensure_output_handler()
        process = functools.partial(
            self.input_processor.process_inputs,
            request_id,
            prompt,
            params,
            arrival_time=time.time(),
            priority=priority,
            cache_salt=cache_salt,
            lora_request=lora_request,
        )
        if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
            # Image processing takes tens of ms: off the event loop, so streams go on.
            request, prompt_text = await asyncio.to_thread(process)
        else:
            request, prompt_text = process()
        queue = RequestOutputCollector(request.sampling_params.output_kind)
        await self._send(self.front_end.add_request(request, prompt_text, queue))
        return queue

    async def _send(self, requests: list[EngineCoreRequest]) -> None:
        """One request, or a parent's n > 1 children (to one core together)."""
        if not requests[0].mm_features:
            await self.engine_core.add_requests_async(requests)
            return
        # The core's mirror of the processor cache replays the commits in the order the
        # requests arrive: commit and send as one, one request at a time.
        async with self._mm_send_lock:
            for request in requests:
                await self.engine_core.add_request_async(self.input_processor.commit_mm(request))

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        # aclosing: a consumer closing this generator closes the stream, which aborts.
        stream = self._stream(
            prompt, sampling_params, request_id, priority, cache_salt, lora_request
        )
        async with contextlib.aclosing(stream):
            async for output in stream:
                assert isinstance(output, RequestOutput)
                yield output

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams,
        request_id: str,
        *,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """A pooling request's one output (its vector); same contract as generate()."""
        stream = self._stream(prompt, pooling_params, request_id, 0, None, lora_request)
        async with contextlib.aclosing(stream):
            async for output in stream:
                if isinstance(output, RequestOutput):  # the engine failed it: no vector
                    raise RuntimeError(output.error or "the pooling request ended, no vector")
                yield output

    async def _stream(
        self,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        request_id: str,
        priority: int,
        cache_salt: str | None,
        lora_request: LoRARequest | None,
    ) -> AsyncGenerator[AnyRequestOutput, None]:
        queue: RequestOutputCollector | None = None
        try:
            queue = await self.add_request(
                request_id,
                prompt,
                params,
                priority=priority,
                cache_salt=cache_salt,
                lora_request=lora_request,
            )
            finished = False
            while not finished:
                # Without awaiting when an output is ready: a fast consumer keeps up cheaply.
                output = queue.get_nowait() or await queue.get()
                finished = output.finished
                yield output
        except (asyncio.CancelledError, GeneratorExit):
            # The consumer went away (e.g. an HTTP client disconnect): free its KV blocks.
            if queue is not None:
                await self._abort(request_id, notify=False)
            raise
        except BaseException:
            if queue is not None and not self.errored:
                await self._abort(request_id, notify=False)
            raise

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Aborts requests; a consumer still iterating gets a final 'abort' output."""
        await self._abort(request_id, notify=True)

    async def _abort(self, request_id: str | Iterable[str], notify: bool) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if notify:
            self._notify_aborted(ids)
        core_ids = self.front_end.abort(ids)
        if core_ids and not self.errored:
            try:
                await self.engine_core.abort_requests_async(core_ids)
            except EngineDeadError:
                pass  # nothing left to free

    def _notify_aborted(self, ids: list[str]) -> None:
        op = self.output_processor
        for request_id in ids:
            parent = op.parent_requests.get(request_id)
            for core_id in sorted(parent.child_requests) if parent else [request_id]:
                state = op.request_states.get(core_id)
                if state is None or state.queue is None:
                    continue
                output = state.make_request_output([], FinishReason.ABORT, None)
                if output is not None:
                    state.queue.put(output)

    # --- the output handler ------------------------------------------------------------

    def _ensure_output_handler(self) -> None:
        if self._output_handler is not None:
            return
        loop = asyncio.get_running_loop()
        self._output_handler = loop.create_task(self._run_output_handler(), name="OutputHandler")
        if any(isinstance(s, LoggingStatLogger) for s in self.front_end.stat_loggers):
            self._stats_logger_task = loop.create_task(self._run_stats_logger())

    async def _run_output_handler(self) -> None:
        try:
            while True:
                outputs = await self.engine_core.get_output_async()
                await self._process_engine_outputs(outputs)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            error = (
                e
                if isinstance(e, EngineDeadError)
                else EngineDeadError(f"engine output handler failed: {type(e).__name__}: {e}")
            )
            if not isinstance(e, EngineDeadError):
                logger.exception("AsyncLLM output handler failed")
            self._dead_error = error
            self.output_processor.propagate_error(error)

    async def _process_engine_outputs(self, outputs: EngineCoreOutputs) -> None:
        now = time.time()
        iteration_stats = None
        if self.log_stats:
            iteration_stats = self.front_end.request_stats.make_iteration_stats(
                outputs.outputs, outputs.scheduled_times, now
            )
        if outputs.outputs:
            start = time.perf_counter()
            processed = self.output_processor.process_outputs(outputs.outputs, now)
            if iteration_stats is not None:
                iteration_stats.output_processing_time = time.perf_counter() - start
            if processed.reqs_to_abort:
                # Finished here by a stop string: the core must stop generating them.
                await self.engine_core.abort_requests_async(processed.reqs_to_abort)
                if iteration_stats is not None:
                    self.front_end.request_stats.finish_requests(
                        processed.reqs_to_abort, str(FinishReason.STOP), iteration_stats
                    )
        self.front_end.record(outputs.scheduler_stats, iteration_stats, outputs.engine_index)

    async def _run_stats_logger(self) -> None:
        while True:
            await asyncio.sleep(STATS_LOG_INTERVAL_S)
            for stat_logger in self.front_end.stat_loggers:
                stat_logger.log()

    # --- utilities ---------------------------------------------------------------------

    async def reset_prefix_cache(self) -> bool:
        return await self.engine_core.reset_prefix_cache_async()

    async def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode: the core frees its KV cache (and its weights, level 2) and
        keeps its process; requests are refused (EngineSleepingError) until wake_up.
        EngineBusyError while requests are in flight (their KV would go)."""
        if not self.config.model_config.enable_sleep_mode:
            raise ValueError("sleep mode is off: start the engine with enable_sleep_mode")
        check_sleep_level(level)
        unfinished = self.output_processor.get_num_unfinished_requests()
        if unfinished:
            raise EngineBusyError(
                f"cannot sleep with {unfinished} request(s) in flight: "
                "let them finish or abort them first"
            )
        # Refuse new requests from now on, not from when the core answers.
        self._sleeping = True
        try:
            self._sleeping = await self.engine_core.sleep_async(level)
        except BaseException:
            self._sleeping = await self.is_sleeping()
            raise

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Gives back what sleep freed: every tag, or those of ("weights", "kv_cache");
        requests are taken again once none sleeps."""
        self._sleeping = await self.engine_core.wake_up_async(check_wake_tags(tags))

    async def is_sleeping(self) -> bool:
        return await self.engine_core.is_sleeping_async()

    @property
    def sleeping(self) -> bool:
        return self._sleeping

    async def request_census(self) -> dict[str, dict[str, int]]:
        """Per process, what every owner of per-request state still holds (all 0 once
        every request has ended; see utils/census.py)."""
        return {
            "api_server": self.front_end.request_census(),
            **await self.engine_core.request_census_async(),
        }

    async def get_scheduler_stats(self) -> SchedulerStats:
        """The core's current stats (a round trip to the engine-core process)."""
        return await self.engine_core.get_stats_async()

    def add_stat_logger(self, stat_logger: StatLoggerBase) -> None:
        self.front_end.stat_loggers.append(stat_logger)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Wake every consumer still waiting: nothing will answer them now.
        self.output_processor.propagate_error(EngineDeadError("the engine has been shut down"))
        for task in (self._output_handler, self._stats_logger_task):
            if task is not None and not task.get_loop().is_closed():
                task.cancel()
        self.engine_core.shutdown()
