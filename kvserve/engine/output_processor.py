"""Turns EngineCoreOutputs into RequestOutputs: detokenize, stop strings, logprobs, kinds."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.logprobs import LogprobsProcessor
from kvserve.engine.parallel_sampling import ParentRequest
from kvserve.outputs import (
    AnyRequestOutput,
    CompletionOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
)
from kvserve.protocol.engine_core import EngineCoreOutput, EngineCoreRequest, FinishReason
from kvserve.sampling_params import RequestOutputKind
from kvserve.utils.census import per_request

if TYPE_CHECKING:
    # Annotations only: transformers loads when a tokenizer is built, not on import.
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


def make_pooling_output(
    request_id: str, vector: list[float], prompt_token_ids: list[int]
) -> PoolingRequestOutput:
    import torch  # only pooling servers pay for it in the front end

    data = torch.tensor(vector, dtype=torch.float32)
    return PoolingRequestOutput(request_id, PoolingOutput(data), prompt_token_ids)


@per_request
class RequestOutputCollector:
    """Single-slot hand-off from the output loop to one request's consumer (async server).

    When the consumer falls behind, a newer output is merged into the waiting one instead
    of queueing: DELTA pieces concatenate, CUMULATIVE/FINAL outputs replace.
    """

    def __init__(self, output_kind: RequestOutputKind) -> None:
        self.aggregate = output_kind == RequestOutputKind.DELTA
        self.output: AnyRequestOutput | Exception | None = None
        self.ready = asyncio.Event()

    def put(self, output: AnyRequestOutput | Exception) -> None:
        if self.output is None or isinstance(output, Exception):
            self.output = output
            self.ready.set()
        elif isinstance(self.output, RequestOutput) and isinstance(output, RequestOutput):
            self.output.add(output, aggregate=self.aggregate)

    async def get(self) -> AnyRequestOutput:
        while (output := self.output) is None:
            await self.ready.wait()
        self.output = None
        self.ready.clear()
        if isinstance(output, Exception):
            raise output
        return output

    def get_nowait(self) -> AnyRequestOutput | None:
        output = self.output
        if output is None:
            return None
        self.output = None
        self.ready.clear()
        if isinstance(output, Exception):
            raise output
        return output


@dataclass
class OutputProcessorOutput:
    request_outputs: list[AnyRequestOutput]
    # Requests finished here (stop strings) that the engine core must abort.
    reqs_to_abort: list[str]


@per_request
@dataclass
class RequestState:
    """Front-end state of one engine-core request (one sample of a user request)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    detokenizer: IncrementalDetokenizer
    logprobs_processor: LogprobsProcessor
    metrics: RequestMetrics
    parent_req: ParentRequest | None = None
    request_index: int = 0
    queue: RequestOutputCollector | None = None
    num_cached_tokens: int = 0
    _num_logprobs_sent: int = field(default=0, repr=False)

    @classmethod
    def from_new_request(
        cls,
        tokenizer: PreTrainedTokenizerBase | None,
        request: EngineCoreRequest,
        prompt: str | None,
        parent_req: ParentRequest | None,
        request_index: int,
        queue: RequestOutputCollector | None,
    ) -> RequestState:
        return cls(
            request_id=request.request_id,
            prompt=prompt,
            prompt_token_ids=request.prompt_token_ids,
            output_kind=request.sampling_params.output_kind,
            detokenizer=IncrementalDetokenizer.from_new_request(tokenizer, request),
            logprobs_processor=LogprobsProcessor.from_new_request(tokenizer, request),
            metrics=RequestMetrics(
                arrival_time=request.arrival_time, last_token_time=request.arrival_time
            ),
            parent_req=parent_req,
            request_index=request_index,
            queue=queue,
        )

    @property
    def external_id(self) -> str:
        return self.parent_req.request_id if self.parent_req else self.request_id

    def make_request_output(
        self,
        new_token_ids: list[int],
        finish_reason: FinishReason | None,
        stop_reason: int | str | None,
        error: str | None = None,
        kv_transfer_params: dict | None = None,
    ) -> RequestOutput | None:
        finished = finish_reason is not None
        if not finished and self.output_kind == RequestOutputKind.FINAL_ONLY:
            return None
        delta = self.output_kind == RequestOutputKind.DELTA
        completion = self._completion(new_token_ids, delta, finish_reason, stop_reason, error)
        request_id, outputs, out_finished = self.request_id, [completion], finished
        if self.parent_req is not None:
            request_id, outputs, out_finished = self.parent_req.get_outputs(
                self.request_id, completion
            )
            if not outputs:
                return None
        lp = self.logprobs_processor
        prompt_logprobs = lp.pop_prompt_logprobs() if delta else lp.prompt_logprobs
        return RequestOutput(
            request_id=request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=outputs,
            finished=out_finished,
            metrics=dataclasses.replace(self.metrics),
            num_cached_tokens=self.num_cached_tokens,
            kv_transfer_params=kv_transfer_params,
        )

    def _completion(
        self,
        new_token_ids: list[int],
        delta: bool,
        finish_reason: FinishReason | None,
        stop_reason: int | str | None,
        error: str | None,
    ) -> CompletionOutput:
        finished = finish_reason is not None
        text = self.detokenizer.get_next_output_text(finished, delta)
        token_ids = new_token_ids if delta else list(self.detokenizer.output_token_ids)
        logprobs = self.logprobs_processor.logprobs
        if logprobs is not None and delta:
            logprobs = logprobs[self._num_logprobs_sent :]
            self._num_logprobs_sent += len(logprobs)
        return CompletionOutput(
            index=self.request_index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=self.logprobs_processor.cumulative_logprob,
            logprobs=logprobs if delta or logprobs is None else list(logprobs),
            finish_reason=str(finish_reason) if finished else None,
            stop_reason=stop_reason,
            error=error,
        )


class OutputProcessor:
    """Front-end output side of the engine; one instance serves all requests."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, log_stats: bool = False) -> None:
        self.tokenizer = tokenizer
        # Metrics are filled either way (a few floats per output); log_stats is kept for
        # the aggregate stat loggers that read them.
        self.log_stats = log_stats
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}

    def request_census(self) -> dict[str, int]:
        return {
            "request_states": len(self.request_states),
            "parent_requests": len(self.parent_requests),
        }

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def unfinished_request_ids(self) -> list[str]:
        """User-facing ids (parent ids for n > 1) of requests still running."""
        return list(dict.fromkeys(s.external_id for s in self.request_states.values()))

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        parent_req: ParentRequest | None = None,
        request_index: int = 0,
        queue: RequestOutputCollector | None = None,
    ) -> None:
        if request.request_id in self.request_states:
            raise ValueError(f"request id {request.request_id!r} is already running")
        self.request_states[request.request_id] = RequestState.from_new_request(
            self.tokenizer, request, prompt, parent_req, request_index, queue
        )
        if parent_req is not None:
            self.parent_requests[parent_req.request_id] = parent_req

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forgets the requests (user ids or child ids); returns the engine-core ids to abort."""
        core_ids: list[str] = []
        for request_id in request_ids:
            parent = self.parent_requests.pop(request_id, None)
            children = sorted(parent.child_requests) if parent else [request_id]
            for child_id in children:
                state = self.request_states.pop(child_id, None)
                if state is None:
                    continue
                core_ids.append(child_id)
                if state.parent_req is not None:
                    state.parent_req.child_requests.discard(child_id)
                    if state.parent_req.finished:
                        self.parent_requests.pop(state.parent_req.request_id, None)
        return core_ids

    def propagate_error(self, e: Exception) -> None:
        """Hands an engine failure to every waiting async consumer."""
        for state in self.request_states.values():
            if state.queue is not None:
                state.queue.put(e)

    def process_outputs(
        self,
        engine_core_outputs: list[EngineCoreOutput],
        engine_core_timestamp: float | None = None,
    ) -> OutputProcessorOutput:
        # Metrics use this process's wall clock, the clock of arrival_time; the core's
        # timestamp (a monotonic clock in another process) is not comparable with it.
        now = time.time()
        request_outputs: list[AnyRequestOutput] = []
        reqs_to_abort: list[str] = []
        for eco in engine_core_outputs:
            state = self.request_states.get(eco.request_id)
            if state is None:
                continue  # aborted while the core was still working on it
            try:
                output = self._process_one(state, eco, now, reqs_to_abort)
            except Exception as e:
                # This request's own output failed (detokenizing, logprobs...): it alone
                # ends with an error, the rest of the batch is unaffected.
                logger.exception("processing the output of request %s failed", eco.request_id)
                output = self._fail(state, f"{type(e).__name__}: {e}", reqs_to_abort)
            if output is None:
                continue
            if state.queue is not None:
                state.queue.put(output)
            else:
                request_outputs.append(output)
        return OutputProcessorOutput(request_outputs=request_outputs, reqs_to_abort=reqs_to_abort)

    def _process_one(
        self,
        state: RequestState,
        eco: EngineCoreOutput,
        now: float,
        reqs_to_abort: list[str],
    ) -> AnyRequestOutput | None:
        self._update_metrics(state, eco, now)
        if eco.pooling_output is not None:
            state.metrics.finished_time = now
            self._forget(state)
            return make_pooling_output(state.request_id, eco.pooling_output, state.prompt_token_ids)
        finish_reason, stop_reason = eco.finish_reason, eco.stop_reason
        stop_string = state.detokenizer.update(
            eco.new_token_ids, finish_reason == FinishReason.STOP
        )
        if stop_string is not None:
            # A stop string ends the request here even if the core already stopped it
            # for another reason (e.g. length) in the same step.
            if finish_reason is None:
                reqs_to_abort.append(eco.request_id)
            finish_reason, stop_reason = FinishReason.STOP, stop_string
        state.logprobs_processor.update_from_output(eco)
        if eco.num_cached_tokens:
            state.num_cached_tokens = eco.num_cached_tokens
        if finish_reason is not None:
            state.metrics.finished_time = now
        output = state.make_request_output(
            eco.new_token_ids, finish_reason, stop_reason, eco.error, eco.kv_transfer_params
        )
        if finish_reason is not None:
            self._forget(state)
        return output

    def _fail(self, state: RequestState, error: str, reqs_to_abort: list[str]) -> RequestOutput:
        """Ends the user request of ``state`` (every sample of it) with ``error``."""
        # The core may still be generating for it (or its sibling samples): stop them all.
        reqs_to_abort.extend(self.abort_requests([state.external_id]))
        failed = CompletionOutput(
            index=state.request_index,
            text="",
            token_ids=[],
            finish_reason=str(FinishReason.ERROR),
            error=error,
        )
        return RequestOutput(
            request_id=state.external_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=None,
            outputs=[failed],
            finished=True,
        )

    def _forget(self, state: RequestState) -> None:
        del self.request_states[state.request_id]
        parent = state.parent_req
        if parent is not None and parent.finished:
            self.parent_requests.pop(parent.request_id, None)

    @staticmethod
    def _update_metrics(state: RequestState, eco: EngineCoreOutput, now: float) -> None:
        if not eco.new_token_ids:
            return
        m = state.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now
        m.num_generation_tokens += len(eco.new_token_ids)
