"""The model's own sampling defaults, as vLLM takes them from its generation config.

A HF checkpoint's ``generation_config.json`` (or a GGUF file's ``general.sampling.*``
metadata, which llama.cpp writes from it) may recommend a temperature, top-p, top-k,
min-p, repetition penalty and output length. vLLM makes those the default sampling
parameters unless ``generation_config="vllm"``; kvserve does the same. The names returned
are SamplingParams fields (``max_new_tokens`` becomes ``max_tokens``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from kvserve.transformers_utils.gguf_reader import open_gguf
from kvserve.transformers_utils.model_resolver import ResolvedModel

# generation_config.json key -> SamplingParams field (vLLM's list).
_HF_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# llama.cpp's GGUF keys for the same recommendations.
_GGUF_FIELDS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
_INT_FIELDS = {"top_k", "max_tokens"}


def _typed(field: str, value: Any) -> int | float:
    if isinstance(value, np.ndarray | np.generic):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"generation config: {field} must be a number, got {value!r}")
    return int(value) if field in _INT_FIELDS else float(value)


def _from_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read generation config {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"generation config {path} is not a JSON object")
    return {
        field: _typed(field, data[key])
        for key, field in _HF_FIELDS.items()
        if data.get(key) is not None
    }


def load_generation_defaults(
    resolved: ResolvedModel, source: str, overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The sampling defaults (SamplingParams field -> value) for ``source``.

    ``source``: "auto" (the model's own: generation_config.json next to a HF checkpoint, or
    the GGUF metadata), "vllm" (none: SamplingParams' defaults), or a folder holding a
    generation_config.json. ``overrides`` (vLLM's override_generation_config, HF key
    names) are applied on top. Raises ValueError naming what it cannot read.
    """
    found: dict[str, Any] = {}
    if source == "auto":
        if resolved.format == "gguf":
            reader = open_gguf(resolved.path)
            found = {
                field: _typed(field, reader.get(key))
                for key, field in _GGUF_FIELDS.items()
                if reader.get(key) is not None
            }
        else:
            path = Path(resolved.path) / "generation_config.json"
            found = _from_json(path) if path.is_file() else {}
    elif source != "vllm":
        path = Path(source).expanduser() / "generation_config.json"
        if not path.is_file():
            raise ValueError(
                f"generation_config must be 'auto', 'vllm' or a folder holding "
                f"generation_config.json; {path} does not exist"
            )
        found = _from_json(path)
    for key, value in (overrides or {}).items():
        if key not in _HF_FIELDS:
            raise ValueError(
                f"override_generation_config: unknown key {key!r}; known: {', '.join(_HF_FIELDS)}"
            )
        found[_HF_FIELDS[key]] = _typed(_HF_FIELDS[key], value)
    return found
