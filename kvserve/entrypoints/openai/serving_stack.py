"""ServingStack: the serving objects over one model's engine, as every route uses them."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses

from kvserve.engine.engine_client import EngineClient
from kvserve.entrypoints.openai.serving_chat import OpenAIServingChat
from kvserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from kvserve.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from kvserve.entrypoints.openai.serving_messages import AnthropicServingMessages
from kvserve.entrypoints.openai.serving_models import OpenAIServingModels
from kvserve.entrypoints.openai.serving_responses import OpenAIServingResponses
from kvserve.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from kvserve.entrypoints.openai.serving_transcription import OpenAIServingTranscription


@dataclasses.dataclass(frozen=True)
class ServingStack:
    engine_client: EngineClient
    models: OpenAIServingModels
    chat: OpenAIServingChat
    completion: OpenAIServingCompletion
    responses: OpenAIServingResponses
    embedding: OpenAIServingEmbedding
    tokenization: OpenAIServingTokenization
    messages: AnthropicServingMessages
    transcription: OpenAIServingTranscription


def build_serving_stack(
    engine_client: EngineClient, models: OpenAIServingModels, args: argparse.Namespace
) -> ServingStack:
    """The stack over ``engine_client``; ``models`` (its name and LoRA adapters) outlives
    the engine, so an adapter stays registered when its model is unloaded and reloaded."""
    chat = OpenAIServingChat(
        engine_client,
        models,
        chat_template=chat_template(args),
        tool_call_parser=getattr(args, "tool_call_parser", None),
        reasoning_parser=getattr(args, "reasoning_parser", None),
    )
    completion = OpenAIServingCompletion(engine_client, models)
    responses = OpenAIServingResponses(
        chat, enable_store=getattr(args, "enable_store_responses", False)
    )
    for serving in (chat, completion, responses):
        serving.log_requests = not getattr(args, "disable_log_requests", False)
    return ServingStack(
        engine_client=engine_client,
        models=models,
        chat=chat,
        completion=completion,
        responses=responses,
        embedding=OpenAIServingEmbedding(engine_client, models),
        tokenization=OpenAIServingTokenization(chat),
        messages=AnthropicServingMessages(chat),
        transcription=OpenAIServingTranscription(engine_client, models),
    )


def serving_models(engine_client: EngineClient, args: argparse.Namespace) -> OpenAIServingModels:
    """A model's name and adapters (``--lora-modules`` at start), from its first engine."""
    lora_modules = dict(getattr(args, "lora_modules", None) or [])
    lora_config = engine_client.config.lora_config
    if lora_modules and lora_config is None:
        raise ValueError("--lora-modules needs --enable-lora")
    return OpenAIServingModels(engine_client.model_config, lora_config, lora_modules)


def chat_template(args: argparse.Namespace) -> str | None:
    """--chat-template is a file path or the template text itself."""
    value: str | None = getattr(args, "chat_template", None)
    if value is None:
        return None
    with contextlib.suppress(OSError):
        with open(value, encoding="utf-8") as f:
            return f.read()
    return value
