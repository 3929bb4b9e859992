"""Prompt inputs (kvserve/inputs.py): where a string is not text."""

from __future__ import annotations

import json

from kvserve.inputs import unpaired_surrogate_path


def test_an_unpaired_surrogate_is_found_with_its_path() -> None:
    body = json.loads('{"messages": [{"role": "user", "content": "ok"}, {"content": "a\\ud800"}]}')
    assert unpaired_surrogate_path(body) == ("messages", 1, "content")
    assert unpaired_surrogate_path("\udc00") == ()
    assert unpaired_surrogate_path({"stop": ("x", "\ud83d")}) == ("stop", 1)


def test_the_first_field_in_the_body_is_named_first() -> None:
    assert unpaired_surrogate_path({"a": "\ud800", "b": "\ud800"}) == ("a",)
    assert unpaired_surrogate_path(["\ud800", ["\udc00"]]) == (0,)


def test_a_key_is_checked_too() -> None:
    assert unpaired_surrogate_path({"extra": {"\ud800": 1}}) == ("extra", "'\\ud800'")


def test_paired_escapes_and_other_text_pass() -> None:
    assert json.loads('"\\ud83d\\ude00"') == "\U0001f600"
    body = {
        "prompt": json.loads('"smile \\ud83d\\ude00"'),
        "n": 2,
        "stop": ["é", "日本"],
        "x": None,
    }
    assert unpaired_surrogate_path(body) is None
