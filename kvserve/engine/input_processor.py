"""Prompts in, validated EngineCoreRequests out: tokenize, check, fill sampling defaults."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jinja2
import msgspec

from kvserve.config import LoRAConfig, ModelConfig, MultiModalConfig, SchedulerConfig
from kvserve.inputs import UNPAIRED_SURROGATE, PromptType, unpaired_surrogate_path
from kvserve.lora.peft_config import read_peft_config
from kvserve.lora.request import LoRARequest
from kvserve.pooling_params import PoolingParams
from kvserve.protocol.engine_core import EngineCoreRequest
from kvserve.protocol.kv_blend import parse_blend_params
from kvserve.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    # Annotations only: transformers loads when a tokenizer is built, not on import.
    from transformers import PreTrainedTokenizerBase

    from kvserve.engine.mm_input import MultiModalInputs


class InputProcessor:
    def __init__(
        self,
        model_config: ModelConfig,
        tokenizer: PreTrainedTokenizerBase | None,
        scheduler_config: SchedulerConfig | None = None,
        structured_outputs_backend: str = "auto",
        lora_config: LoRAConfig | None = None,
        mm_config: MultiModalConfig | None = None,
    ) -> None:
        self.model_config = model_config
        # Images (kvserve/engine/mm_input.py); None for text-only models.
        self.mm_inputs: MultiModalInputs | None = None
        if model_config.arch.multimodal is not None:
            from kvserve.engine.mm_input import MultiModalInputs

            self.mm_inputs = MultiModalInputs(
                model_config, mm_config or MultiModalConfig(), scheduler_config
            )
        self.structured_outputs_backend = structured_outputs_backend
        self.lora_config = lora_config
        self.tokenizer = tokenizer
        self.scheduler_policy = scheduler_config.policy if scheduler_config else "fcfs"
        assert model_config.max_model_len is not None
        # The scheduler's bound is the whole sequence: past the context in sink mode.
        self.max_model_len: int = (
            scheduler_config.max_model_len if scheduler_config else model_config.max_model_len
        )
        self.vocab_size = model_config.vocab_size
        self.max_logprobs = model_config.max_logprobs
        eos_ids = list(model_config.arch.eos_token_ids)
        if not eos_ids and tokenizer is not None and tokenizer.eos_token_id is not None:
            eos_ids = [tokenizer.eos_token_id]
        self.eos_token_id: int | None = eos_ids[0] if eos_ids else None
        # Further end-of-turn ids (e.g. <|eot_id|>) stop like stop_token_ids do.
        self.extra_eos_token_ids = eos_ids[1:]
        # The model's never-emitted tokens (Whisper's generation config), as HF applies them.
        mm = model_config.arch.multimodal
        self.suppressed_words = [[t] for t in mm.suppress_tokens] if mm else []
        self.begin_suppress_token_ids = list(mm.begin_suppress_tokens) if mm else []

    def process_inputs(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> tuple[EngineCoreRequest, str | None]:
        """Returns the core request and the prompt text (None when only ids were given).

        Raises ValueError, naming the offending field, for anything the engine cannot run.
        """
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {type(request_id).__name__}")
        if priority != 0 and self.scheduler_policy != "priority":
            raise ValueError(
                f"priority={priority} is only supported with the 'priority' scheduling "
                f"policy (the engine uses {self.scheduler_policy!r})"
            )
        self._validate_lora(lora_request)
        pooling_params = self._pooling_params(params)
        mm_features = None
        prompt_text: str | None
        if isinstance(prompt, Mapping) and "encoder_prompt" in prompt:
            prompt = _from_encoder_decoder_prompt(prompt)  # type: ignore[assignment]
        if isinstance(prompt, Mapping) and prompt.get("multi_modal_data"):
            if self.mm_inputs is None:
                raise ValueError(
                    f"multi_modal_data: {self.model_config.arch.architecture} is a text-only model"
                )
            prompt_text, prompt_token_ids, mm_features = self.mm_inputs.process(prompt, cache_salt)
        else:
            prompt_text, prompt_token_ids = self._tokenize(prompt)
        self._validate_prompt(prompt_token_ids)
        mm_arch = self.model_config.arch.multimodal
        if mm_arch is not None and mm_arch.encoder_decoder and not mm_features:
            raise ValueError(
                f"multi_modal_data: {self.model_config.arch.architecture} needs its encoder "
                "input, e.g. {'prompt': '<|startoftranscript|>...', "
                "'multi_modal_data': {'audio': (samples, sampling_rate)}}"
            )
        if pooling_params is not None:
            # Nothing is sampled: the scheduler ends the request when its prompt is done.
            params = SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY)
        assert isinstance(params, SamplingParams)
        params = self._finalize_params(params, len(prompt_token_ids))
        kv_transfer_params = (params.extra_args or {}).get("kv_transfer_params")
        parse_blend_params(kv_transfer_params)  # a bad blend option is the caller's error
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            priority=priority,
            cache_salt=cache_salt,
            kv_transfer_params=kv_transfer_params,
            pooling_params=pooling_params,
            lora_request=lora_request,
            mm_features=mm_features,
        )
        return request, prompt_text

    def commit_mm(self, request: EngineCoreRequest) -> EngineCoreRequest:
        """The request as it is sent: its images the processor cache holds go as their
        hash alone. Call it right before the send and only then (the engine core's mirror
        of the cache moves with each request it receives, so must this one)."""
        if not request.mm_features or self.mm_inputs is None:
            return request
        return msgspec.structs.replace(
            request, mm_features=self.mm_inputs.commit(request.mm_features)
        )

    def _pooling_params(self, params: SamplingParams | PoolingParams) -> PoolingParams | None:
        """The request's PoolingParams; the runner decides which kind of params it takes."""
        if isinstance(params, PoolingParams):
            if not self.model_config.is_pooling:
                raise ValueError(
                    "PoolingParams (embed/encode) need a pooling model: start the engine "
                    "with runner='pooling' or task='embed'"
                )
            params.verify(self.model_config.arch.hidden_size)
            return params
        if self.model_config.is_pooling and isinstance(params, SamplingParams):
            raise ValueError(
                "this engine runs the pooling runner: it returns embeddings "
                "(LLM.embed / /v1/embeddings), it does not generate text"
            )
        return None

    def _validate_lora(self, lora_request: LoRARequest | None) -> None:
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(
                f"lora_request must be a LoRARequest, got {type(lora_request).__name__}"
            )
        if self.lora_config is None:
            raise ValueError(
                f"LoRA adapter {lora_request.lora_name!r} requested, but LoRA is not "
                "enabled: start the engine with enable_lora=True"
            )
        # The adapter's config is checked here so a bad one fails this request alone,
        # before the worker tries to load it in the middle of a step.
        read_peft_config(lora_request.lora_path, self.lora_config.max_lora_rank)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            text: str | None = prompt
            ids = None
        elif isinstance(prompt, Mapping):
            text = prompt.get("prompt")
            ids = prompt.get("prompt_token_ids")
            if text is not None and not isinstance(text, str):
                raise ValueError(f"prompt must be a string, got {type(text).__name__}")
            if ids is None and text is None:
                raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
        else:
            raise ValueError(
                "prompt must be a string, {'prompt': str} or {'prompt_token_ids': [int, ...]}, "
                f"got {type(prompt).__name__}"
            )
        if ids is not None:
            if (
                not isinstance(ids, Sequence)
                or isinstance(ids, str)
                or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
            ):
                raise ValueError("prompt_token_ids must be a list of integers")
            if len(ids) == 0:
                raise ValueError("prompt_token_ids is empty: a prompt needs at least one token")
            return text, list(ids)
        assert text is not None
        if not text:
            raise ValueError("prompt is empty: a prompt needs at least one token")
        if self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer; pass prompt_token_ids instead")
        if unpaired_surrogate_path(text) is not None:
            raise ValueError(f"prompt {UNPAIRED_SURROGATE}")
        return text, list(self.tokenizer.encode(text, add_special_tokens=True))

    def _validate_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("prompt is empty: it tokenizes to 0 tokens")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt_token_ids contains token ids outside the vocabulary "
                f"[0, {self.vocab_size}): {bad[:5]}"
            )
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"The prompt ({len(ids)} tokens) is longer than the maximum model length of "
                f"{self.max_model_len} (at least one position must be left to generate). "
                "Make the prompt shorter or raise max_model_len."
            )

    def _finalize_params(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        params.verify_against_vocab(self.vocab_size)
        self._check_logprobs(params)
        changes: dict[str, Any] = {}
        # A copy per request: callers reuse one SamplingParams for many prompts.
        if params.max_tokens is None:
            changes["max_tokens"] = self.max_model_len - prompt_len
        # prompt_len + max_tokens > max_model_len is accepted: the scheduler finishes the
        # request with "length" when it reaches max_model_len.
        if params.bad_words or self.suppressed_words:
            words = self._tokenize_bad_words(params.bad_words) if params.bad_words else []
            changes["_bad_words_token_ids"] = words + self.suppressed_words
        if self.begin_suppress_token_ids:
            changes["_begin_suppress_token_ids"] = self.begin_suppress_token_ids
        if params.structured_outputs is not None:
            changes["structured_outputs"] = self._resolve_structured_outputs(
                params.structured_outputs
            )
        params = params.clone(**changes)
        if self.extra_eos_token_ids and not params.ignore_eos:
            # Set after clone(): __post_init__ rebuilds this list from stop_token_ids.
            params._all_stop_token_ids = list(
                dict.fromkeys([*params.all_stop_token_ids, *self.extra_eos_token_ids])
            )
        return params

    def _resolve_structured_outputs(self, spec: StructuredOutputsParams) -> StructuredOutputsParams:
        """Checks the grammar here, so a bad schema or regex is the caller's ValueError and
        never reaches the engine core, and records the backend that runs it."""
        # Imported here: the grammar libraries load with the first constrained request.
        from kvserve.structured_output.backend_types import resolve_backend

        backend = resolve_backend(spec._backend or self.structured_outputs_backend, spec)
        return msgspec.structs.replace(spec, _backend=backend)

    def _check_logprobs(self, params: SamplingParams) -> None:
        """vLLM's max_logprobs: a request may ask for at most that many (-1 in either
        place: the whole vocabulary, allowed only when max_logprobs is -1)."""
        if self.max_logprobs == -1:
            return
        for field in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, field)
            if asked is not None and (asked == -1 or asked > self.max_logprobs):
                raise ValueError(
                    f"{field}={asked} is more than max_logprobs={self.max_logprobs} "
                    "(raise the engine's max_logprobs)"
                )

    def _tokenize_bad_words(self, bad_words: list[str]) -> list[list[int]]:
        if self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer")
        out: list[list[int]] = []
        for word in bad_words:
            word = word.strip()
            if not word:
                raise ValueError("bad_words cannot contain an empty string")
            # A word is banned at the start of the text and after a space; with BPE those
            # are different token sequences.
            for variant in (word, " " + word):
                ids = list(self.tokenizer.encode(variant, add_special_tokens=False))
                if ids and ids not in out:
                    out.append(ids)
        bad = [t for ids in out for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"bad_words tokenize to ids outside the vocabulary: {bad[:5]}")
        return out


# apply_chat_template's own arguments: a template variable may not override them.
_TEMPLATE_ARGS = frozenset(
    {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
     "continue_final_message", "tokenize", "padding", "truncation", "max_length",
     "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}
)  # fmt: skip


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase | None,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    continue_final_message: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """Renders a conversation to the prompt text the model was trained on (not tokenized).
    ``chat_template_kwargs``: more variables for the template (``enable_thinking``)."""
    reserved = _TEMPLATE_ARGS.intersection(chat_template_kwargs or {})
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(sorted(reserved))}")
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be True")
    if tokenizer is None:
        raise ValueError("chat messages need a tokenizer; the engine runs with skip_tokenizer_init")
    if chat_template is None and not tokenizer.chat_template:
        # Base models (Gemma 3 270M) ship none: guessing a format would silently
        # prompt the model in one it was never trained on.
        raise ValueError(
            "the model's tokenizer has no chat template (a base model?): pass one "
            "(LLM.chat(chat_template=...), `kvserve serve --chat-template FILE`, or the "
            "request's chat_template); kvserve/entrypoints/chat_templates/ holds examples"
        )
    conversation = _normalize_messages(messages)
    if continue_final_message and conversation[-1]["role"] != "assistant":
        raise ValueError("continue_final_message needs the last message to be the assistant's")
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            tools=tools,  # type: ignore[arg-type]
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **(chat_template_kwargs or {}),
        )
    except jinja2.TemplateError as e:
        raise ValueError(f"the chat template failed on these messages: {e}") from e
    assert isinstance(text, str)
    return text


def _normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Checks each message and flattens OpenAI-style text parts into one string."""
    if not isinstance(messages, list | tuple) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ValueError(f"messages[{i}] must be a dict, got {type(msg).__name__}")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}] is missing 'role' (a non-empty string)")
        if "content" not in msg and not msg.get("tool_calls"):
            raise ValueError(f"messages[{i}] is missing 'content'")
        content = msg.get("content")
        if isinstance(content, list) and any(
            isinstance(p, Mapping) and p.get("type") == "image" for p in content
        ):
            # Image parts stay parts: the template places the model's image marker.
            content = [
                p if isinstance(p, Mapping) else {"type": "text", "text": p} for p in content
            ]
        elif isinstance(content, list):
            content = _join_text_parts(content, i)
        elif content is None and not msg.get("tool_calls"):
            raise ValueError(f"messages[{i}].content is None (only allowed with tool_calls)")
        elif content is not None and not isinstance(content, str):
            raise ValueError(
                f"messages[{i}].content must be a string or a list of text parts, "
                f"got {type(content).__name__}"
            )
        out.append({**msg, "content": content})
    return out


def _join_text_parts(parts: list[Any], i: int) -> str:
    texts: list[str] = []
    for part in parts:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, Mapping) and part.get("type") == "text":
            if not isinstance(part.get("text"), str):
                raise ValueError(f"messages[{i}] has a text part without a 'text' string")
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ValueError(
                f"messages[{i}] has a content part of type {kind!r}; only text is supported"
            )
    return "\n".join(texts)


def _from_encoder_decoder_prompt(prompt: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's explicit form ``{"encoder_prompt": {..., "multi_modal_data": ...},
    "decoder_prompt": str | {"prompt": str}}`` -> the plain form this processor reads
    (the encoder's input as multi_modal_data, the decoder's text as the prompt)."""
    encoder = prompt["encoder_prompt"]
    decoder = prompt.get("decoder_prompt")
    if not isinstance(encoder, Mapping) or not encoder.get("multi_modal_data"):
        raise ValueError("encoder_prompt must be a dict with multi_modal_data (the audio)")
    if isinstance(decoder, Mapping):
        decoder = decoder.get("prompt")
    if not isinstance(decoder, str) or not decoder:
        raise ValueError("decoder_prompt must be the decoder's text, e.g. '<|startoftranscript|>'")
    return {"prompt": decoder, "multi_modal_data": encoder["multi_modal_data"]}
