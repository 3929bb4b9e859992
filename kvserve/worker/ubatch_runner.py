"""The model runner's forward, whole or as two overlapped micro-batches (vLLM's dual
batch overlap, ``--enable-dbo``; its UBatchWrapper).

With DBO on, a step big enough (ubatch_splitting.py) runs as two micro-batches of whole
requests whose forwards take turns at each tensor-parallel all-reduce (ubatching.py):
while one micro-batch's partial sums travel between the ranks, the other computes. Each
micro-batch has attention metadata of its own, built from its slice of the step's
common metadata by a builder set of its own; their hidden states are joined in the
step's token order, so the output head and the sampler see one batch as before.

With DBO off the runner is the no-op form: the model runs the whole step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from kvserve.attention.backends.utils import slice_common_attn_metadata
from kvserve.config import ParallelConfig
from kvserve.forward_context import get_forward_context
from kvserve.worker.input_preparation import StepInputs
from kvserve.worker.kv_cache_binder import KVCacheBinder
from kvserve.worker.ubatch_splitting import (
    UBatchSlice,
    create_ubatch_slices,
    reads_later_writes,
)
from kvserve.worker.ubatching import UBatchThreads

logger = logging.getLogger(__name__)


# How the step runs as one batch (the CUDA graph runner's forward: a graph's replay, or
# the model run eagerly).
WholeForward = Callable[[Any, StepInputs, dict[str, Any]], Any]


class UBatchRunner:
    """The no-op form: every step runs as one batch."""

    # Steps run as micro-batches so far (tests and `kvserve bench ubatch` read it).
    num_ubatched_steps: int = 0

    def forward(
        self, model: Any, inputs: StepInputs, model_kwargs: dict[str, Any], whole: WholeForward
    ) -> Any:
        return whole(model, inputs, model_kwargs)

    def shutdown(self) -> None:
        pass


NO_UBATCH_RUNNER = UBatchRunner()


class DualBatchOverlapRunner(UBatchRunner):
    def __init__(self, parallel_config: ParallelConfig, binder: KVCacheBinder) -> None:
        self.decode_threshold = parallel_config.dbo_decode_token_threshold
        self.prefill_threshold = parallel_config.dbo_prefill_token_threshold
        self.binder = binder
        # A builder keeps its buffers until its next build: each micro-batch needs its own.
        self.builders = [binder.new_builders(), binder.new_builders()]
        self.block_sizes = [builder.block_size for builder in binder.attn_builders]
        self.threads = UBatchThreads()
        self.num_ubatched_steps = 0

    def split(self, inputs: StepInputs) -> list[UBatchSlice] | None:
        """The step's micro-batches, or None to run it whole."""
        slices = create_ubatch_slices(
            inputs.query_start_loc_np, self.decode_threshold, self.prefill_threshold
        )
        if slices is None or reads_later_writes(
            inputs.common_attn_metadata, self.block_sizes, slices
        ):
            return None
        return slices

    def forward(
        self, model: Any, inputs: StepInputs, model_kwargs: dict[str, Any], whole: WholeForward
    ) -> Any:
        slices = None if model_kwargs else self.split(inputs)
        if slices is None:
            return whole(model, inputs, model_kwargs)
        # Micro-batches run eagerly (vLLM captures graphs of them; not done here).
        metadata = [
            self.binder.build_metadata(
                [
                    slice_common_attn_metadata(c, s.request_slice, s.token_slice)
                    for c in inputs.common_attn_metadata
                ],
                builders=builders,
            )
            for s, builders in zip(slices, self.builders, strict=True)
        ]
        forwards = [_forward_of(model, inputs, s.token_slice) for s in slices]
        hidden = self.threads.run(get_forward_context(), metadata, forwards)
        self.num_ubatched_steps += 1
        return torch.cat(hidden)

    def shutdown(self) -> None:
        self.threads.shutdown()


def _forward_of(model: Any, inputs: StepInputs, tokens: slice) -> Callable[[], Any]:
    return lambda: model(inputs.input_ids[tokens], inputs.positions[tokens])


def make_ubatch_runner(parallel_config: ParallelConfig, binder: KVCacheBinder) -> UBatchRunner:
    if not parallel_config.enable_dbo:
        return NO_UBATCH_RUNNER
    logger.info(
        "dual batch overlap: steps of %d+ tokens (%d+ decode-only) run as two micro-batches",
        parallel_config.dbo_prefill_token_threshold,
        parallel_config.dbo_decode_token_threshold,
    )
    return DualBatchOverlapRunner(parallel_config, binder)
