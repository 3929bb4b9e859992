"""`POST /tokenize` and `POST /detokenize`: the server's own tokenizer, for clients that count."""

from __future__ import annotations

from kvserve.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from kvserve.entrypoints.openai.serving_chat import OpenAIServingChat
from kvserve.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    def __init__(self, serving_chat: OpenAIServingChat) -> None:
        super().__init__(serving_chat.engine_client, serving_chat.models)
        # Chat requests are rendered exactly as /v1/chat/completions renders them.
        self.serving_chat = serving_chat

    async def create_tokenize(
        self, request: TokenizeCompletionRequest | TokenizeChatRequest
    ) -> TokenizeResponse:
        self.models.resolve(request.model)
        if isinstance(request, TokenizeChatRequest):
            _, ids = await self.serving_chat.render_prompt(
                request.messages,
                request.add_generation_prompt and not request.continue_final_message,
                request.continue_final_message,
                request.chat_template,
            )
        else:
            ids = await self.tokenize(request.prompt, request.add_special_tokens)
        token_strs = (
            self.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        )
        return TokenizeResponse(
            count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=token_strs
        )

    async def create_detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.models.resolve(request.model)
        self.check_token_ids(request.tokens, "tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(request.tokens))
