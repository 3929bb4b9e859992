"""The LogitsProcessor interface (vLLM v1 shape) and the batch changes it is told about."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto
from typing import TYPE_CHECKING

from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    # The front end loads processor classes to check their names: no torch for that.
    import torch


class MoveDirectionality(Enum):
    UNIDIRECTIONAL = auto()  # src moves into the empty row dst (condensing holes)
    SWAP = auto()  # rows a and b exchange places


# (row, params, prompt token ids, output token ids). The output list is the live list the
# model runner appends to, so a processor can read the current output without copies.
AddedRequest = tuple[int, SamplingParams, list[int], list[int]]
RemovedRequest = int
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass(frozen=True)
class BatchUpdate:
    """Changes to the persistent batch since the last update, applied in this order:
    added (a row may reuse a freed row), then removed, then moved."""

    batch_size: int
    added: Sequence[AddedRequest]
    removed: Sequence[RemovedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    """Batch-level logits processor. Row i of the logits given to `apply` is row i of the
    persistent batch; per-row state is kept in sync through `update_state`."""

    @abstractmethod
    def __init__(self, max_num_reqs: int, device: torch.device, is_pin_memory: bool) -> None:
        raise NotImplementedError

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Returns the processed logits (may modify `logits` in place)."""
        raise NotImplementedError

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if the processor can never change the argmax of a row; such processors run
        after temperature and only when some row samples randomly."""
        raise NotImplementedError

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called once before every step that samples; None means the batch did not change
        (the processor may still refresh state that depends on the output so far)."""
        raise NotImplementedError

    def is_noop(self) -> bool:
        """True when `apply` would leave the logits unchanged (no row uses this processor), so
        the sampler can skip work. Processors that don't override it always run."""
        return False
