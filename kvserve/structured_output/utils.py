"""Grammar text shared by the backends: choices and legacy structural tags as grammars."""

from __future__ import annotations

import json
from typing import Any


def choice_as_ebnf(choices: list[str]) -> str:
    """`root ::= "a" | "b"`: JSON string escapes are valid EBNF string escapes."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def choice_as_lark(choices: list[str]) -> str:
    return "start: " + " | ".join(json.dumps(c) for c in choices)


def legacy_structural_tag(tag: Any) -> tuple[list[dict[str, Any]], list[str]] | None:
    """vLLM's structural tag form, {"structures": [{begin, schema, end}], "triggers": [...]},
    as (structures, triggers); None for another form. Raises ValueError when malformed."""
    if not isinstance(tag, dict) or "structures" not in tag:
        return None
    structures, triggers = tag["structures"], tag.get("triggers")
    if not isinstance(structures, list) or not isinstance(triggers, list) or not triggers:
        raise ValueError("a structural tag needs a 'structures' list and a 'triggers' list")
    for s in structures:
        if not isinstance(s, dict) or not {"begin", "schema", "end"} <= s.keys():
            raise ValueError("each structure needs 'begin', 'schema' and 'end'")
    return structures, triggers
