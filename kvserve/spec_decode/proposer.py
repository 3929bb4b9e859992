"""The proposer interface and its registry (``speculative_config.method`` -> class)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

if TYPE_CHECKING:
    import torch

    from kvserve.config import EngineConfig


@dataclass
class ProposerInputs:
    """The persistent batch after a step's tokens were appended, for the rows that sampled.

    ``token_ids[r, :num_tokens[r]]`` are batch row r's known tokens (prompt and output).
    """

    rows: np.ndarray  # int64 [S]: batch rows that sampled this step, ascending
    req_ids: list[str]  # [S]
    token_ids: np.ndarray  # int32 [max_num_reqs, max_model_len]
    num_tokens: np.ndarray  # int32 [max_num_reqs]
    num_prompt_tokens: np.ndarray  # int32 [max_num_reqs]
    # Per batch row: tokens with KV in the cache before this step (the scheduler's count).
    num_computed_before: np.ndarray  # int32 [max_num_reqs]
    # The batch's MultiGroupBlockTable (a worker type; this layer cannot name it).
    block_table: Any = None


class Proposer(ABC):
    """Drafts up to ``num_speculative_tokens`` tokens per sampling row after each step."""

    registry: ClassVar[dict[str, type[Proposer]]] = {}
    method: ClassVar[str]

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "method" in cls.__dict__:
            Proposer.registry[cls.method] = cls

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        spec = config.speculative_config
        assert spec is not None and spec.num_speculative_tokens is not None
        self.config = config
        self.device = device
        self.num_speculative_tokens = spec.num_speculative_tokens

    @abstractmethod
    def propose(self, inputs: ProposerInputs) -> list[list[int]]:
        """Drafts per row of ``inputs.rows`` (possibly empty lists)."""

    def remove_requests(self, req_ids: set[str]) -> None:  # noqa: B027 - optional hook
        """Forgets finished requests (proposers that keep per-request state)."""

    def request_census(self) -> dict[str, int]:
        """Live per-request entries (none for a stateless proposer)."""
        return {}

    # Hooks for proposers that run a model of their own (draft_model).

    def load_model(self) -> None:  # noqa: B027 - optional hook
        """Loads the proposer's weights (called by the runner's load_model)."""

    def attention_layers(self) -> dict[str, Any]:
        """The proposer's attention layers by (unique) name: they join the KV cache config,
        so their caches live in the same blocks as the target's."""
        return {}

    def bind_kv_cache(  # noqa: B027 - optional hook
        self,
        kv_caches: dict[str, torch.Tensor],
        attn_builders: list[Any],
        layer_to_group: dict[str, int],
    ) -> None:
        """Receives the allocated caches and the runner's attention metadata builders."""


class NoOpProposer(Proposer):
    """The drafter of a runner without speculative_config: no drafts, no model, no state."""

    def __init__(self) -> None:  # nothing to configure
        self.num_speculative_tokens = 0

    def propose(self, inputs: ProposerInputs) -> list[list[int]]:
        return [[] for _ in range(len(inputs.rows))]


def create_proposer(config: EngineConfig, device: torch.device) -> Proposer | None:
    spec = config.speculative_config
    if spec is None:
        return None
    # Importing the modules registers their classes.
    from kvserve.spec_decode import draft_model, ngram_proposer, suffix_decoding  # noqa: F401

    assert spec.method is not None
    return Proposer.registry[spec.method](config, device)
