"""What the engine hands back to users: RequestOutput with one CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    # The front end makes tensors only for pooling outputs: torch loads then, not here.
    import torch


@dataclass
class Logprob:
    """One candidate token at one position: its logprob, vocabulary rank (1 = best) and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated position: token id -> Logprob (sampled token first, then top-k).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt position; the first is None because nothing predicts it.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class RequestMetrics:
    """Wall-clock (time.time()) timestamps of one request's life, filled by the front end."""

    arrival_time: float
    last_token_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    time_in_queue: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One sample of a request. ``finish_reason`` is "stop", "length", "abort", "error" or None
    while running; ``stop_reason`` is the stop string or stop token id that ended it."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # The engine's message when finish_reason == "error".
    error: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, "
            f"token_ids={self.token_ids}, cumulative_logprob={self.cumulative_logprob}, "
            f"logprobs={_short(self.logprobs)}, finish_reason={self.finish_reason!r}, "
            f"stop_reason={self.stop_reason!r}"
            + (f", error={self.error!r})" if self.error else ")")
        )


@dataclass
class RequestOutput:
    """The state of one user request: its prompt and the samples generated so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int | None = None
    kv_transfer_params: dict | None = None

    @property
    def error(self) -> str | None:
        """The first sample's error message, if the engine failed this request."""
        return next((c.error for c in self.outputs if c.error), None)

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """Merges a newer output of the same request into this one (a slow consumer).

        ``aggregate`` is for DELTA outputs: texts, tokens and logprobs concatenate. Otherwise
        each newer completion replaces the older one of the same index.
        """
        self.finished |= next_output.finished
        self.kv_transfer_params = next_output.kv_transfer_params or self.kv_transfer_params
        self.metrics = next_output.metrics or self.metrics
        if next_output.prompt_logprobs is not None:
            if aggregate:
                self.prompt_logprobs = (self.prompt_logprobs or []) + next_output.prompt_logprobs
            else:
                self.prompt_logprobs = next_output.prompt_logprobs
        by_index = {c.index: i for i, c in enumerate(self.outputs)}
        for new in next_output.outputs:
            pos = by_index.get(new.index)
            if pos is None:
                self.outputs.append(new)
                continue
            if not aggregate:
                self.outputs[pos] = new
                continue
            old = self.outputs[pos]
            old.text += new.text
            old.token_ids = old.token_ids + new.token_ids
            if new.logprobs is not None:
                old.logprobs = (old.logprobs or []) + new.logprobs
            old.cumulative_logprob = new.cumulative_logprob
            old.finish_reason = new.finish_reason
            old.stop_reason = new.stop_reason
            old.error = new.error
        self.outputs.sort(key=lambda c: c.index)

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
            f"prompt_token_ids={self.prompt_token_ids}, "
            f"prompt_logprobs={_short(self.prompt_logprobs)}, outputs={self.outputs}, "
            f"finished={self.finished}, metrics={self.metrics}, "
            f"num_cached_tokens={self.num_cached_tokens})"
        )


def _short(items: list | None) -> str:
    # Logprob lists get long; the repr shows how many positions, not every dict.
    return "None" if items is None else f"<{len(items)} positions>"


@dataclass
class PoolingOutput:
    """A pooling request's vector (vLLM's name; ``data`` is a float32 tensor there too)."""

    data: torch.Tensor


@dataclass
class PoolingRequestOutput:
    """The result of a pooling request: one vector for the whole prompt."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @property
    def error(self) -> str | None:
        return None


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """``LLM.embed``'s result for one prompt (vLLM's shape)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(
            output.request_id,
            EmbeddingOutput(output.outputs.data.tolist()),
            output.prompt_token_ids,
            output.finished,
        )


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """``LLM.score``'s result for one (text_1, text_2) pair: their embeddings' cosine."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


# What the engine's output processing yields: generated text, or a pooled vector.
AnyRequestOutput = RequestOutput | PoolingRequestOutput
