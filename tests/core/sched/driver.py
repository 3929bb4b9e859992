"""A stand-in for the workers that drives a real Scheduler step by step in tests.

It keeps the block tables the workers would keep (from the scheduler outputs' diffs),
checks them against the KV cache manager, and samples a fixed token (or chosen ones)
for every request that caught up, as a model runner's output would carry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvserve.core.request import Request
from kvserve.core.sched.scheduler import Scheduler
from kvserve.protocol.engine_core import EngineCoreOutput, EngineCoreOutputs, FinishReason
from kvserve.protocol.runner_output import ModelRunnerOutput
from kvserve.protocol.scheduler_output import SchedulerOutput

BS = 4
TOKEN = 7  # what the fake model samples unless told otherwise
EOS = 2


class Driver:
    """Plays the workers: keeps block tables from the output diffs and samples tokens."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.tables: dict[str, list[int]] = {}
        self.outputs: dict[str, list[EngineCoreOutput]] = {}

    def add(self, *requests: Request) -> None:
        for request in requests:
            self.scheduler.add_request(request)

    def step(
        self,
        tokens: dict[str, int] | None = None,
        fail_if: Callable[[set[str]], bool] | frozenset[str] | set[str] = frozenset(),
        **runner: Any,
    ) -> tuple[SchedulerOutput, EngineCoreOutputs]:
        """One step. It fails, as a model step that raises does, if it runs one of the ids
        in fail_if, or if fail_if (a predicate on the step's ids) says so."""
        sched = self.scheduler
        out = self.schedule()
        scheduled = set(out.num_scheduled_tokens)
        if fail_if(scheduled) if callable(fail_if) else fail_if & scheduled:
            failed = sched.isolate_failed_step(out, "RuntimeError: the step failed")
            engine_outputs = EngineCoreOutputs(outputs=failed)
            self._record(engine_outputs)
            sched.check_integrity()
            return out, engine_outputs
        return out, self.update(out, tokens, **runner)

    def schedule(self) -> SchedulerOutput:
        """A step's schedule, its diffs applied to the block tables as the workers would."""
        out = self.scheduler.schedule()
        self._apply_diffs(out)
        return out

    def update(
        self, out: SchedulerOutput, tokens: dict[str, int] | None = None, **runner: Any
    ) -> EngineCoreOutputs:
        """The output of the step ``out`` (sampled for every request that caught up)."""
        sched = self.scheduler
        req_ids = list(out.num_scheduled_tokens)
        sampled = [
            [(tokens or {}).get(rid, TOKEN)]
            if sched.requests[rid].num_computed_tokens >= sched.requests[rid].num_tokens
            else []
            for rid in req_ids
        ]
        runner_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            **runner,
        )
        engine_outputs = sched.update_from_output(out, runner_output)
        self._record(engine_outputs)
        sched.check_integrity()
        return engine_outputs

    def _record(self, engine_outputs: EngineCoreOutputs) -> None:
        for output in engine_outputs.outputs:
            self.outputs.setdefault(output.request_id, []).append(output)

    def _apply_diffs(self, out: SchedulerOutput) -> None:
        sched = self.scheduler
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        assert out.total_num_scheduled_tokens <= sched.max_num_scheduled_tokens
        assert len(out.num_scheduled_tokens) <= sched.max_num_running_reqs
        for rid in out.finished_req_ids:
            self.tables.pop(rid, None)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.tables
            self.tables[new.req_id] = list(new.block_ids[0])
        cached = out.scheduled_cached_reqs
        for rid, resumed, new_ids in zip(
            cached.req_ids, cached.resumed_from_preemption, cached.new_block_ids, strict=True
        ):
            if resumed:
                assert new_ids is not None
                self.tables[rid] = list(new_ids[0])
            elif new_ids is not None:
                self.tables[rid].extend(new_ids[0])
        for rid in out.num_scheduled_tokens:
            # The workers' table equals the manager's, and holds every scheduled token.
            assert self.tables[rid] == sched.kv_cache_manager.get_block_ids(rid)[0]
            assert len(self.tables[rid]) * BS >= sched.requests[rid].num_computed_tokens

    def run(self, max_steps: int = 200) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_requests():
                return
            self.step()
        raise AssertionError("the scheduler did not finish its requests")

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.outputs.get(rid, []) for t in o.new_token_ids]

    def finish_reason(self, rid: str) -> FinishReason | None:
        return self.outputs[rid][-1].finish_reason
