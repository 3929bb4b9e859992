"""Bodies of the Responses API (`/v1/responses`), as the openai SDK reads them."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field

from kvserve.entrypoints.openai.protocol import (
    INT64_MAX,
    OpenAIBaseModel,
    ShortString,
    _SamplingRequest,
    random_uuid,
)
from kvserve.sampling_params import SamplingParams


class ResponsesRequest(_SamplingRequest):
    """OpenAI's fields (input, instructions, max_output_tokens, store, ...) on top of the
    sampling knobs completions and chat share (one sample: ``n`` must stay 1)."""

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    # OpenAI stores by default; this server only when started with --enable-store-responses.
    store: bool = True
    previous_response_id: ShortString | None = None
    # Function tools in the Responses shape ({"type": "function", "name", "parameters",
    # ...}, flat); responses_tools checks them, naming the offending one.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, Any] | None = None

    def to_sampling_params(
        self, max_tokens: int, defaults: Mapping[str, Any] | None = None
    ) -> SamplingParams:
        if self.n != 1:
            raise ValueError(f"n must be 1 for /v1/responses, got {self.n}")
        return self._sampling_params(max_tokens, None, self.stream, defaults)


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class ResponseOutputText(OpenAIBaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class ResponseOutputMessage(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"msg_{random_uuid()}")
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus = "in_progress"
    content: list[ResponseOutputText] = Field(default_factory=list)


class ResponseReasoningText(OpenAIBaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ResponseReasoningItem(OpenAIBaseModel):
    """A thinking model's reasoning (--reasoning-parser), the item before the message."""

    id: str = Field(default_factory=lambda: f"rs_{random_uuid()}")
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ResponseReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"


class ResponseFunctionToolCall(OpenAIBaseModel):
    """A function call the model made; the client answers with a function_call_output
    item of the same call_id."""

    id: str = Field(default_factory=lambda: f"fc_{random_uuid()}")
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str  # JSON text
    status: ItemStatus = "completed"


ResponseOutputItem = ResponseReasoningItem | ResponseOutputMessage | ResponseFunctionToolCall


class InputTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIBaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int

    @classmethod
    def of(cls, input_tokens: int, output_tokens: int, cached_tokens: int) -> ResponseUsage:
        return cls(
            input_tokens=input_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens),
            output_tokens=output_tokens,
            total_tokens=input_tokens + output_tokens,
        )


class IncompleteDetails(OpenAIBaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponsesResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"resp_{random_uuid()}")
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    model: str
    status: Literal["in_progress", "completed", "incomplete", "failed"] = "in_progress"
    output: list[ResponseOutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    previous_response_id: str | None = None
    incomplete_details: IncompleteDetails | None = None
    error: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[Any] = Field(default_factory=list)
    store: bool = False
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})

    @property
    def output_text(self) -> str:
        return "".join(
            part.text
            for item in self.output
            if isinstance(item, ResponseOutputMessage)
            for part in item.content
        )
