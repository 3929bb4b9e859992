"""Per-iteration and per-request statistics the front end derives from engine-core outputs.

All timestamps are wall clock (time.time()), taken in the front-end process when a batch
of EngineCoreOutputs arrives, except the scheduling times, which the core reports.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kvserve.protocol.engine_core import EngineCoreOutput
from kvserve.utils.census import per_request


@per_request
@dataclass
class RequestStateStats:
    """Front-end timestamps of one engine-core request."""

    arrival_time: float
    num_prompt_tokens: int
    scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float = 0.0
    num_generation_tokens: int = 0


@dataclass
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    # Arrival to first scheduled (the whole life when it never was).
    queued_time: float
    # Mean gap between output tokens after the first (0 with fewer than two tokens).
    mean_time_per_output_token: float


@dataclass
class IterationStats:
    """What one batch of engine-core outputs contributed."""

    iteration_timestamp: float = field(default_factory=time.time)
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens_iter: list[float] = field(default_factory=list)
    inter_token_latencies_iter: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    # Front-end seconds spent turning this batch into RequestOutputs (detokenizing incl.).
    output_processing_time: float = 0.0

    def update_from_output(self, output: EngineCoreOutput, req: RequestStateStats) -> None:
        num_new = len(output.new_token_ids)
        if not num_new:
            return
        now = self.iteration_timestamp
        if req.first_token_time is None:
            # The prefill finished in this iteration: the whole prompt counts once, here.
            self.num_prompt_tokens += req.num_prompt_tokens
            self.time_to_first_tokens_iter.append(now - req.arrival_time)
            req.first_token_time = now
        else:
            self.inter_token_latencies_iter.append(now - req.last_token_time)
        req.last_token_time = now
        req.num_generation_tokens += num_new
        self.num_generation_tokens += num_new

    def update_from_finished_request(self, finish_reason: str, req: RequestStateStats) -> None:
        now = self.iteration_timestamp
        scheduled = req.scheduled_time if req.scheduled_time is not None else now
        decode_time = (
            req.last_token_time - req.first_token_time if req.first_token_time is not None else 0.0
        )
        self.finished_requests.append(
            FinishedRequestStats(
                finish_reason=finish_reason,
                e2e_latency=now - req.arrival_time,
                num_prompt_tokens=req.num_prompt_tokens,
                num_generation_tokens=req.num_generation_tokens,
                queued_time=max(scheduled - req.arrival_time, 0.0),
                mean_time_per_output_token=(
                    decode_time / (req.num_generation_tokens - 1)
                    if req.num_generation_tokens > 1
                    else 0.0
                ),
            )
        )


class RequestStatsTracker:
    """Keeps RequestStateStats for every running engine-core request and turns each batch
    of outputs into an IterationStats."""

    def __init__(self) -> None:
        self.requests: dict[str, RequestStateStats] = {}

    def add_request(self, request_id: str, arrival_time: float, num_prompt_tokens: int) -> None:
        self.requests[request_id] = RequestStateStats(arrival_time, num_prompt_tokens)

    def request_census(self) -> dict[str, int]:
        return {"requests": len(self.requests)}

    def make_iteration_stats(
        self,
        outputs: Iterable[EngineCoreOutput],
        scheduled_times: Mapping[str, float] | None = None,
        now: float | None = None,
    ) -> IterationStats:
        stats = IterationStats(iteration_timestamp=now if now is not None else time.time())
        for request_id, scheduled_time in (scheduled_times or {}).items():
            req = self.requests.get(request_id)
            if req is not None and req.scheduled_time is None:
                req.scheduled_time = scheduled_time
        for output in outputs:
            req = self.requests.get(output.request_id)
            if req is None:
                continue  # aborted in the front end while the core was stepping
            stats.update_from_output(output, req)
            if output.finish_reason is not None:
                stats.update_from_finished_request(str(output.finish_reason), req)
                del self.requests[output.request_id]
        return stats

    def finish_requests(
        self, request_ids: Iterable[str], finish_reason: str, stats: IterationStats
    ) -> None:
        """Requests the front end ended (stop strings, aborts): recorded into ``stats``."""
        for request_id in request_ids:
            req = self.requests.pop(request_id, None)
            if req is not None:
                stats.update_from_finished_request(finish_reason, req)
