"""Anthropic Messages API bodies (`/v1/messages`, `/v1/messages/count_tokens`) as pydantic
models: the fields kvserve serves; other fields are accepted and ignored, as Anthropic does."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from kvserve.entrypoints.openai.protocol import (
    INT64_MAX,
    MAX_STOP_STRINGS,
    OpenAIRequestModel,
    ShortString,
    StopString,
    XArg,
    random_uuid,
)

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class TextBlockParam(OpenAIRequestModel):
    type: Literal["text"]
    text: str


class Base64ImageSource(OpenAIRequestModel):
    type: Literal["base64"]
    media_type: str
    data: str


class URLImageSource(OpenAIRequestModel):
    type: Literal["url"]
    url: str


class ImageBlockParam(OpenAIRequestModel):
    type: Literal["image"]
    source: Annotated[Base64ImageSource | URLImageSource, Field(discriminator="type")]

    def image_url_part(self) -> dict[str, Any]:
        """The OpenAI content part the chat path loads images from."""
        source = self.source
        if isinstance(source, URLImageSource):
            url = source.url
        else:
            url = f"data:{source.media_type};base64,{source.data}"
        return {"type": "image_url", "image_url": {"url": url}}


class ToolUseBlockParam(OpenAIRequestModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlockParam(OpenAIRequestModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: (
        str | list[Annotated[TextBlockParam | ImageBlockParam, Field(discriminator="type")]] | None
    ) = None
    is_error: bool = False


class ThinkingBlockParam(OpenAIRequestModel):
    """A previous turn's reasoning, which clients send back; not shown to the model again."""

    type: Literal["thinking", "redacted_thinking"]


ContentBlockParam = Annotated[
    TextBlockParam
    | ImageBlockParam
    | ToolUseBlockParam
    | ToolResultBlockParam
    | ThinkingBlockParam,
    Field(discriminator="type"),
]


class MessageParam(OpenAIRequestModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlockParam]


class ToolParam(OpenAIRequestModel):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]


class _ToolChoiceBase(OpenAIRequestModel):
    disable_parallel_tool_use: bool = False


class ToolChoiceAuto(_ToolChoiceBase):
    type: Literal["auto"]


class ToolChoiceAny(_ToolChoiceBase):
    type: Literal["any"]


class ToolChoiceTool(_ToolChoiceBase):
    type: Literal["tool"]
    name: str


class ToolChoiceNone(OpenAIRequestModel):
    type: Literal["none"]


ToolChoice = Annotated[
    ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")
]


class AnthropicCountTokensRequest(OpenAIRequestModel):
    """The conversation part of a request: what its prompt is made of."""

    model: ShortString
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlockParam] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None


class AnthropicMessagesRequest(AnthropicCountTokensRequest):
    max_tokens: int = Field(ge=1, le=INT64_MAX)
    stop_sequences: list[StopString] | None = Field(None, max_length=MAX_STOP_STRINGS)
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=INT64_MAX)
    metadata: dict[str, Any] | None = None
    stream: bool = False
    # kvserve's extra, as on the OpenAI routes: arguments for custom logits processors.
    vllm_xargs: dict[ShortString, XArg | list[XArg]] | None = Field(None, max_length=64)


class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingBlock(BaseModel):
    """A thinking model's reasoning (--reasoning-parser); unsigned: nothing to verify."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class AnthropicUsage(BaseModel):
    input_tokens: int
    output_tokens: int


class AnthropicMessagesResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"msg_{random_uuid()}")
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ThinkingBlock | TextBlock | ToolUseBlock] = Field(default_factory=list)
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: AnthropicUsage


class AnthropicCountTokensResponse(BaseModel):
    input_tokens: int


class AnthropicErrorInfo(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorInfo
