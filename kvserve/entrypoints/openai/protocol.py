"""OpenAI-compatible request and response bodies (pydantic), with vLLM's extra fields."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)
from pydantic.types import StringConstraints
from pydantic_core import InitErrorDetails, PydanticCustomError, ValidationError

from kvserve.entrypoints.openai.protocol_structured import (
    ChatCompletionToolsParam,
    DeltaToolCall,
    StructuredOutputsRequestFields,
    ToolCall,
    ToolChoice,
)
from kvserve.inputs import UNPAIRED_SURROGATE, unpaired_surrogate_path
from kvserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

# vLLM's default cap on logprobs per position; also OpenAI's top_logprobs limit.
MAX_LOGPROBS = 20
# Per-request limits, checked by the schema (so the OpenAPI document states them and a
# violation is a 400 naming the field). They bound the work and memory one request can ask
# for: n samples share the batch, stop strings are matched on every token, logit_bias
# entries are applied on every step. OpenAI's own limits where it has one (300 logit_bias
# entries, values in [-100, 100]).
MAX_N = 16
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_ID_CHARS = 256
# 64-bit: what the wire format (msgpack) and torch's generators accept.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

StopString = Annotated[str, StringConstraints(max_length=MAX_STOP_STRING_CHARS)]
ShortString = Annotated[str, StringConstraints(max_length=MAX_ID_CHARS)]
# A vllm_xargs value: what a custom logits processor may read from extra_args.
XArg = Annotated[str, StringConstraints(max_length=4096)] | int | float


def random_uuid() -> str:
    return uuid.uuid4().hex


# Characters that str.splitlines() breaks lines at (and so httpx's aiter_lines and much
# hand-written SSE code) but that JSON may carry raw inside a string: generated text can
# hold them. Escaped, every event stays on its one data line.
_SPLITLINES_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_data(body: BaseModel) -> str:
    """One server-sent event carrying ``body`` as JSON."""
    return f"data: {body.model_dump_json().translate(_SPLITLINES_BREAKS)}\n\n"


class OpenAIBaseModel(BaseModel):
    # Clients send fields we do not use (user, store, metadata...): accept and ignore them.
    model_config = ConfigDict(extra="allow")


class OpenAIRequestModel(OpenAIBaseModel):
    """A request body: numbers must be finite ("nan", "inf" and 1e999 are 400s), and
    strings must be text: an unpaired surrogate escape would otherwise reach the tokenizer,
    which refuses it with an exception the client would see as a 500."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _strings_are_text(cls, data: Any) -> Any:
        path = unpaired_surrogate_path(data)
        if path is not None:
            # Raised with the field's own location, so the 400 names it as for any field.
            error = PydanticCustomError("value_error", UNPAIRED_SURROGATE)
            raise ValidationError.from_exception_data(
                cls.__name__, [InitErrorDetails(type=error, loc=path, input=data)]
            )
        return data


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


class OpenAIServingError(Exception):
    """Raised by the serving layer; the app turns it into an ErrorResponse with ``status``."""

    _TYPES: ClassVar[dict[int, str]] = {
        400: "BadRequestError",
        401: "AuthenticationError",
        404: "NotFoundError",
        408: "TimeoutError",
        413: "RequestTooLargeError",
        429: "RateLimitError",
        500: "InternalServerError",
        503: "ServiceUnavailableError",
    }

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        err_type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        # e.g. Retry-After on a 503/429 from admission control.
        self.headers = headers
        self.err_type = err_type or self._TYPES.get(status, "BadRequestError")

    def to_response(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorInfo(
                message=self.message, type=self.err_type, param=self.param, code=self.status
            )
        )


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class StreamOptions(OpenAIRequestModel):
    include_usage: bool = False
    # vLLM's extra: a usage object on every chunk, not only the last.
    continuous_usage_stats: bool = False


class _SamplingRequest(StructuredOutputsRequestFields, OpenAIRequestModel):
    """Fields shared by completions and chat: OpenAI's sampling knobs plus vLLM's extras.

    Ranges are the schema's (a 400 naming the field); SamplingParams checks them again for
    the offline API.
    """

    model: ShortString | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    # vLLM v1 samples n and returns n; best_of is accepted only where it changes nothing.
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        None, max_length=MAX_LOGIT_BIAS_ENTRIES
    )
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: StopString | list[StopString] | None = Field(None, max_length=MAX_STOP_STRINGS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT64_MAX)]] | None = Field(
        None, max_length=MAX_STOP_TOKEN_IDS
    )
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    cache_salt: ShortString | None = None
    request_id: ShortString | None = None
    # vLLM's field: handed to the KV connector (disaggregated prefill), e.g.
    # {"do_remote_decode": true, ...} to a producer; the answer carries the consumer's.
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's field: request arguments for custom logits processors (SamplingParams.extra_args).
    vllm_xargs: dict[ShortString, XArg | list[XArg]] | None = Field(None, max_length=64)

    def _sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        stream: bool,
        defaults: Mapping[str, Any] | None = None,
    ) -> SamplingParams:
        """Raises ValueError (-> 400) for out-of-range values, via SamplingParams.

        ``defaults`` (the model's generation config) fill the knobs the request leaves out.
        """
        default = dict(defaults or {})
        if logprobs is not None and logprobs > MAX_LOGPROBS:
            raise ValueError(f"logprobs must be at most {MAX_LOGPROBS}, got {logprobs}")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of must equal n ({self.n}) if given, got {self.best_of}")
        if self.logit_bias:
            try:
                bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except ValueError:
                raise ValueError("logit_bias keys must be token ids (integers)") from None
        else:
            bias = None
        return SamplingParams(
            n=self.n,
            temperature=default.get("temperature", 1.0)
            if self.temperature is None
            else self.temperature,
            top_p=default.get("top_p", 1.0) if self.top_p is None else self.top_p,
            top_k=default.get("top_k", 0) if self.top_k is None else self.top_k,
            min_p=default.get("min_p", 0.0) if self.min_p is None else self.min_p,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=default.get("repetition_penalty", 1.0)
            if self.repetition_penalty is None
            else self.repetition_penalty,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            logit_bias=bias,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
            structured_outputs=self.structured_outputs_params(),
            extra_args=self._extra_args(),
        )

    def _extra_args(self) -> dict[str, Any] | None:
        extra: dict[str, Any] = dict(self.vllm_xargs or {})
        if self.kv_transfer_params is not None:
            extra["kv_transfer_params"] = self.kv_transfer_params
        return extra or None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# ---------------------------------------------------------------- completions


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    # 0 only with echo: the prompt's log-probs, nothing generated (check_length refuses it
    # otherwise, naming max_tokens).
    max_tokens: int | None = Field(16, ge=0, le=INT64_MAX)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    # vLLM's extras: beam search with beam width n.
    use_beam_search: bool = False
    length_penalty: float = 1.0

    def to_beam_search_params(self, max_tokens: int) -> BeamSearchParams:
        """Raises ValueError (-> 400) for what beam search cannot do."""
        if self.stream or self.logprobs is not None or self.echo:
            raise ValueError("use_beam_search does not support stream, logprobs or echo")
        return BeamSearchParams(
            beam_width=self.n,
            max_tokens=max_tokens,
            ignore_eos=self.ignore_eos,
            temperature=self.temperature or 0.0,
            length_penalty=self.length_penalty,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )

    def to_sampling_params(
        self, max_tokens: int, defaults: Mapping[str, Any] | None = None
    ) -> SamplingParams:
        return self._sampling_params(max_tokens, self.logprobs, self.stream, defaults)


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None
    # What the KV connector returned for the request (vLLM's field; null without one).
    kv_transfer_params: dict[str, Any] | None = None


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------- chat completions


class ChatCompletionRequest(_SamplingRequest):
    # Plain dicts: the chat template renders them and names the offending message on error.
    messages: list[dict[str, Any]]
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(0, ge=0, le=MAX_LOGPROBS)
    tools: list[ChatCompletionToolsParam] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = True
    # vLLM extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    # Variables for the chat template, e.g. {"enable_thinking": false} (Qwen3).
    chat_template_kwargs: dict[ShortString, Any] | None = Field(None, max_length=64)
    # With --reasoning-parser: false drops reasoning_content (the content is still split).
    include_reasoning: bool = True

    def requested_max_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    def to_sampling_params(
        self, max_tokens: int, defaults: Mapping[str, Any] | None = None
    ) -> SamplingParams:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, self.stream, defaults)


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None
    # A thinking model's reasoning (--reasoning-parser); ``reasoning`` is vLLM's newer name.
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    kv_transfer_params: dict[str, Any] | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # OpenAI's deltas carry only what changed: {"content": "..."}, no "role": null.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------- models, tokenizer


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvserve"
    root: str | None = None
    # A LoRA adapter's base model (vLLM's field); None for the base model itself.
    parent: str | None = None
    max_model_len: int | None = None
    # With several models (kvserve serve --model ...): loaded, loading, unloaded, sleeping.
    status: str | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeCompletionRequest(OpenAIRequestModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(OpenAIRequestModel):
    model: str | None = None
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    return_token_strs: bool = False


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIRequestModel):
    model: ShortString | None = None
    tokens: list[Annotated[int, Field(ge=0, le=INT64_MAX)]]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
