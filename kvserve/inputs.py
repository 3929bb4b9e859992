"""The prompt forms the engine accepts: a string, {"prompt": ...} or {"prompt_token_ids": ...}."""

from __future__ import annotations

from typing import Any, NotRequired, TypeAlias, TypedDict


class TextPrompt(TypedDict):
    prompt: str
    # {"image": image or [images]} (PIL images, uint8 numpy arrays or tensors) for a
    # vision-language model; the prompt text marks where each goes.
    multi_modal_data: NotRequired[dict[str, Any]]
    # Per-request processor options, e.g. {"do_pan_and_scan": True}.
    mm_processor_kwargs: NotRequired[dict[str, Any]]


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    # The text the ids came from, if the caller has it (echoed back in RequestOutput.prompt).
    prompt: NotRequired[str]
    multi_modal_data: NotRequired[dict[str, Any]]


PromptType: TypeAlias = str | TextPrompt | TokensPrompt
