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


UNPAIRED_SURROGATE = (
    "holds an unpaired UTF-16 surrogate (such as \\ud800 without its pair), which is not text"
)


def unpaired_surrogate_path(value: Any) -> tuple[str | int, ...] | None:
    """Where in ``value`` (strings, lists, dicts: a decoded JSON body or a prompt) a
    string holds an unpaired UTF-16 surrogate: the keys and indexes down to it (``()``:
    ``value`` itself); None where no string does.

    JSON may spell one (``"\\ud800"`` alone is legal JSON) and Python keeps it in a str,
    but it is not text: UTF-8 cannot encode it and the tokenizers refuse it. Paired
    escapes decode to one character, so any surrogate left in a str is unpaired."""
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, str):
            if not _is_text(item):
                return where
        elif isinstance(item, dict):
            for key in item:
                if isinstance(key, str) and not _is_text(key):
                    return (*where, repr(key))
            # Reversed onto the stack: the first field in the body is reported first.
            stack.extend(reversed([((*where, key), v) for key, v in item.items()]))
        elif isinstance(item, list | tuple):
            stack.extend(reversed([((*where, i), v) for i, v in enumerate(item)]))
    return None


def _is_text(value: str) -> bool:
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
