"""n > 1: one user request fans out into n child requests whose outputs are gathered here."""

from __future__ import annotations

from kvserve.outputs import CompletionOutput
from kvserve.sampling_params import RequestOutputKind, SamplingParams
from kvserve.utils.census import per_request


@per_request
class ParentRequest:
    """Bookkeeping for a request with ``n`` samples.

    Each sample runs in the engine core as its own request ``f"{index}_{parent_id}"`` with
    n=1. They share the prompt, so the prefix cache shares its KV blocks; with a seed,
    child ``index`` gets ``seed + index`` so the samples differ but stay reproducible.
    """

    def __init__(self, request_id: str, sampling_params: SamplingParams) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.n = sampling_params.n
        # Children still running (ids).
        self.child_requests: set[str] = set()
        # FINAL_ONLY: finished completions wait here until the last child is done.
        self.output_aggregator: list[CompletionOutput | None] = [None] * self.n
        self._child_params_no_seed: SamplingParams | None = None

    def get_child_info(self, index: int) -> tuple[str, SamplingParams]:
        """The id and sampling params of child ``index``; registers it as running."""
        if not 0 <= index < self.n:
            raise ValueError(f"child index must be in [0, {self.n}), got {index}")
        child_id = f"{index}_{self.request_id}"
        self.child_requests.add(child_id)
        return child_id, self._child_sampling_params(index)

    def _child_sampling_params(self, index: int) -> SamplingParams:
        seed = self.sampling_params.seed
        if seed is not None:
            # Wrapped into the signed 64-bit range, which seed must stay in.
            child_seed = (seed + index + 2**63) % 2**64 - 2**63
            return self.sampling_params.clone(n=1, seed=child_seed)
        # Without a seed all children have equal params: build them once.
        if self._child_params_no_seed is None:
            self._child_params_no_seed = self.sampling_params.clone(n=1)
        return self._child_params_no_seed

    def get_outputs(
        self, child_request_id: str, completion_output: CompletionOutput
    ) -> tuple[str, list[CompletionOutput], bool]:
        """Folds one child's completion in; returns (parent id, completions to emit, finished).

        CUMULATIVE/DELTA forward each completion as it comes (its ``index`` says which
        sample); FINAL_ONLY emits nothing until every child has finished, then all n in
        index order. ``finished`` is True once the last child is done.
        """
        if completion_output.finished():
            self.child_requests.discard(child_request_id)
        if self.sampling_params.output_kind != RequestOutputKind.FINAL_ONLY:
            outputs = [completion_output]
        else:
            self.output_aggregator[completion_output.index] = completion_output
            done = not self.child_requests
            outputs = [c for c in self.output_aggregator if c is not None] if done else []
        return self.request_id, outputs, not self.child_requests

    @property
    def finished(self) -> bool:
        return not self.child_requests
