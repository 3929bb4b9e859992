"""`POST /v1/messages` and `/v1/messages/count_tokens`: Anthropic's Messages API over the chat path.

A request becomes a chat completion request (OpenAI message dicts, function tools, the
tool_choice the chat path's ChatToolHandler enforces or parses) and runs through
OpenAIServingChat, so templates, images, tool grammars and tool parsing are the chat
endpoint's own; its answer is translated back into Anthropic's message (or event stream).

The mapping: ``system`` is the first message; an assistant's ``tool_use`` blocks are its
``tool_calls`` (content None when it wrote no text); each ``tool_result`` block is one
``role: tool`` message (an ``is_error`` result's text starts with "Error: "); ``image``
blocks are ``image_url`` parts. tool_choice ``auto`` (Anthropic's default when tools are
given) is the chat path's default, ``any`` is ``required``, ``tool`` a named function.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from kvserve.engine.chat_media import has_image_parts
from kvserve.entrypoints.openai.anthropic_stream import (
    MessageStreamConverter,
    anthropic_message_id,
    anthropic_tool_id,
    stop_reason_of,
)
from kvserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    OpenAIServingError,
    StreamOptions,
)
from kvserve.entrypoints.openai.protocol_anthropic import (
    AnthropicCountTokensRequest,
    AnthropicCountTokensResponse,
    AnthropicMessagesRequest,
    AnthropicMessagesResponse,
    AnthropicUsage,
    ContentBlockParam,
    ImageBlockParam,
    MessageParam,
    TextBlock,
    TextBlockParam,
    ThinkingBlock,
    ThinkingBlockParam,
    ToolChoiceAny,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlockParam,
    ToolUseBlock,
    ToolUseBlockParam,
)
from kvserve.entrypoints.openai.protocol_structured import (
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionToolsParam,
    FunctionDefinition,
    NamedFunction,
    ToolCall,
    ToolChoice,
)
from kvserve.entrypoints.openai.serving_chat import OpenAIServingChat


class AnthropicServingMessages:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create_message(
        self, request: AnthropicMessagesRequest, raw_request: Request | None = None
    ) -> AnthropicMessagesResponse | AsyncIterator[str]:
        """An AnthropicMessagesResponse, or (stream=True) an iterator of SSE events."""
        result = await self.chat.create_chat_completion(chat_request(request), raw_request)
        if isinstance(result, ChatCompletionResponse):
            return message_of(result)
        return MessageStreamConverter().events(result)

    async def count_tokens(
        self, request: AnthropicCountTokensRequest
    ) -> AnthropicCountTokensResponse:
        """The prompt's exact length: rendered as create_message renders it."""
        self.chat.models.resolve(request.model)
        messages = chat_messages(request)
        if has_image_parts(messages):
            raise OpenAIServingError(
                "count_tokens does not count image blocks (an image's tokens depend on the "
                "model's processor)",
                param="messages",
            )
        tools = chat_tools(request)
        _, prompt_ids = await self.chat.render_prompt(
            messages,
            add_generation_prompt=True,
            continue_final_message=False,
            chat_template=None,
            tools=[t.model_dump(exclude_none=True) for t in tools] if tools else None,
        )
        return AnthropicCountTokensResponse(input_tokens=len(prompt_ids))


# ---------------------------------------------------------------- Anthropic -> chat


def chat_request(request: AnthropicMessagesRequest) -> ChatCompletionRequest:
    tool_choice, parallel = _tool_choice(request)
    fields = {
        "model": request.model,
        "messages": chat_messages(request),
        "max_tokens": request.max_tokens,
        "stop": request.stop_sequences,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "tools": chat_tools(request),
        "tool_choice": tool_choice,
        "parallel_tool_calls": parallel,
        "stream": request.stream,
        # Usage on every chunk: message_start carries the input tokens.
        "stream_options": StreamOptions(include_usage=True, continuous_usage_stats=True)
        if request.stream
        else None,
        "vllm_xargs": request.vllm_xargs,
    }
    return ChatCompletionRequest.model_validate(fields)


def chat_tools(request: AnthropicCountTokensRequest) -> list[ChatCompletionToolsParam] | None:
    if not request.tools:
        return None
    return [
        ChatCompletionToolsParam(
            function=FunctionDefinition(
                name=t.name, description=t.description, parameters=t.input_schema
            )
        )
        for t in request.tools
    ]


def _tool_choice(request: AnthropicMessagesRequest) -> tuple[ToolChoice | None, bool]:
    """(the chat tool_choice, parallel_tool_calls). ``auto`` and no choice are both the
    chat path's default: tool calls parsed when the server parses them."""
    choice = request.tool_choice
    if choice is None:
        return None, True
    if isinstance(choice, ToolChoiceNone):
        return "none", True
    parallel = not choice.disable_parallel_tool_use
    if isinstance(choice, ToolChoiceAny):
        return "required", parallel
    if isinstance(choice, ToolChoiceTool):
        return ChatCompletionNamedToolChoiceParam(
            function=NamedFunction(name=choice.name)
        ), parallel
    return None, parallel


def chat_messages(request: AnthropicCountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as OpenAI chat messages."""
    out: list[dict[str, Any]] = []
    if isinstance(request.system, str):
        out.append({"role": "system", "content": request.system})
    elif request.system:
        out.append({"role": "system", "content": "\n".join(b.text for b in request.system)})
    for i, message in enumerate(request.messages):
        out += _chat_messages(message, i)
    return out


def _chat_messages(message: MessageParam, i: int) -> list[dict[str, Any]]:
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    if message.role == "assistant":
        return [_assistant_message(message.content, i)]
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(message.content):
        if isinstance(block, TextBlockParam | ImageBlockParam):
            parts.append(_part(block))
        elif isinstance(block, ToolResultBlockParam):
            # Results answer the previous turn's calls: they come before the user's text.
            if parts:
                out.append({"role": "user", "content": _content(parts)})
                parts = []
            out.append(_tool_message(block))
        elif isinstance(block, ToolUseBlockParam):
            raise OpenAIServingError(
                f"messages.{i}.content.{j}: tool_use blocks belong to assistant messages",
                param="messages",
            )
    if parts or not out:
        out.append({"role": "user", "content": _content(parts)})
    return out


def _assistant_message(blocks: list[ContentBlockParam], i: int) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlockParam):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlockParam):
            arguments = json.dumps(block.input, ensure_ascii=False)
            function = {"name": block.name, "arguments": arguments}
            calls.append({"id": block.id, "type": "function", "function": function})
        elif not isinstance(block, ThinkingBlockParam):
            raise OpenAIServingError(
                f"messages.{i}.content.{j}: an assistant message holds text and tool_use "
                f"blocks, not {block.type}",
                param="messages",
            )
    text = "".join(texts)
    if not calls:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": text or None, "tool_calls": calls}


def _tool_message(block: ToolResultBlockParam) -> dict[str, Any]:
    content: str | list[dict[str, Any]]
    if block.content is None or isinstance(block.content, str):
        content = block.content or ""
    else:
        content = _content([_part(b) for b in block.content])
    if block.is_error:
        if isinstance(content, str):
            content = f"Error: {content}"
        else:
            content = [{"type": "text", "text": "Error:"}, *content]
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": content}


def _part(block: TextBlockParam | ImageBlockParam) -> dict[str, Any]:
    if isinstance(block, TextBlockParam):
        return {"type": "text", "text": block.text}
    return block.image_url_part()


def _content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Text alone as one string (what every template renders), else the parts."""
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


# ---------------------------------------------------------------- chat -> Anthropic


def message_of(response: ChatCompletionResponse) -> AnthropicMessagesResponse:
    choice = response.choices[0]
    content: list[ThinkingBlock | TextBlock | ToolUseBlock] = []
    if choice.message.reasoning_content:
        content.append(ThinkingBlock(thinking=choice.message.reasoning_content))
    if choice.message.content:
        content.append(TextBlock(text=choice.message.content))
    content += [_tool_use(call) for call in choice.message.tool_calls]
    stop_reason, stop_sequence = stop_reason_of(
        choice.finish_reason, choice.stop_reason, bool(choice.message.tool_calls)
    )
    return AnthropicMessagesResponse(
        id=anthropic_message_id(response.id),
        model=response.model,
        content=content,
        stop_reason=stop_reason,
        stop_sequence=stop_sequence,
        usage=AnthropicUsage(
            input_tokens=response.usage.prompt_tokens,
            output_tokens=response.usage.completion_tokens,
        ),
    )


def _tool_use(call: ToolCall) -> TextBlock | ToolUseBlock:
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        # Cut short by max_tokens: the partial arguments are kept, as text.
        return TextBlock(text=call.function.arguments)
    return ToolUseBlock(id=anthropic_tool_id(call.id), name=call.function.name, input=arguments)
