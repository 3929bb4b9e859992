"""Config dataclasses from JSON command-line values, with errors naming the flag."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, TypeVar

_Config = TypeVar("_Config")


def dataclass_from_json(cls: type[_Config], value: dict[str, Any] | str, flag: str) -> _Config:
    """A config dataclass from a dict or JSON text, with errors that name the flag."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{flag} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, got {value!r}")
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(
            f"{flag}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    try:
        return cls(**value)
    except TypeError as exc:  # a value of the wrong type, e.g. "hwm": "big"
        raise ValueError(f"{flag}: {exc}") from None
