"""StructuredOutputManager on the real tokenizer: asynchronous compiles, the spec cache, the
bitmask, backend resolution and the registry (no model needed)."""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import pytest

from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured_output import (
    StructuredOutputManager,
    StructuredOutputRequest,
    backend_names,
    get_backend_class,
    resolve_backend,
)

VOCAB = 49152
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.fixture
def manager(tokenizer: Any) -> Any:
    manager = StructuredOutputManager("auto", VOCAB, 4, load_tokenizer=lambda: tokenizer)
    yield manager
    manager.shutdown()


def compiled(manager: StructuredOutputManager, spec: StructuredOutputsParams) -> Any:
    request = StructuredOutputRequest(spec)
    manager.grammar_init(request)
    request._future.result(timeout=60)  # type: ignore[union-attr]
    assert request.is_ready() and request.error is None
    return request.grammar


def allowed(bitmask_row: np.ndarray) -> set[int]:
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")
    return {int(t) for t in np.flatnonzero(bits[:VOCAB])}


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_grammar_walks_to_termination(manager: Any, tokenizer: Any, backend: str) -> None:
    grammar = compiled(manager, StructuredOutputsParams(json=SCHEMA, _backend=backend))
    text_ids = tokenizer.encode('{"ok": true}', add_special_tokens=False)
    for token in text_ids:
        mask = manager.grammar_bitmask([grammar])
        assert token in allowed(mask[0])
        assert grammar.accept_tokens("r", [token])
    assert allowed(manager.grammar_bitmask([grammar])[0]) == {tokenizer.eos_token_id}
    assert not grammar.is_terminated()
    assert grammar.accept_tokens("r", [tokenizer.eos_token_id])
    assert grammar.is_terminated()


def test_same_spec_compiles_once(manager: Any) -> None:
    spec = StructuredOutputsParams(json=SCHEMA, _backend="xgrammar")
    first, second = compiled(manager, spec), compiled(manager, spec)
    assert manager.num_compiles == 1
    assert first is not second, "each request needs its own matcher"
    compiled(manager, StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    assert manager.num_compiles == 2, "options are part of the key"


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_a_bounded_string_admits_no_raw_control_character(
    manager: Any, tokenizer: Any, backend: str
) -> None:
    # xgrammar 0.2.9 compiles maxLength strings to [^"\\\r\n]{0,n}: a soak against a
    # random model got raw control characters (invalid JSON) in such strings.
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 16}},
        "required": ["name"],
    }
    grammar = compiled(manager, StructuredOutputsParams(json=schema, _backend=backend))
    for token in tokenizer.encode('{"name": "ab', add_special_tokens=False):
        assert grammar.accept_tokens("r", [token])
    mask = allowed(manager.grammar_bitmask([grammar])[0])
    control = {
        t
        for t in range(len(tokenizer))
        if (text := tokenizer.decode([t])) and all(ord(c) < 0x20 for c in text)
    }
    assert control, "the vocabulary has tokens of control characters"
    assert not mask & control
    assert tokenizer.encode("c", add_special_tokens=False)[0] in mask


def test_the_compile_cache_is_bounded_in_bytes(manager: Any) -> None:
    schemas = [
        {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
        for i in range(4)
    ]
    compiled(manager, StructuredOutputsParams(json=schemas[0]))
    _, one = manager.cache_stats()
    assert one > 0, "xgrammar reports the size of what it compiled"
    manager.max_cache_bytes = int(2.5 * one)
    for schema in schemas[1:]:
        compiled(manager, StructuredOutputsParams(json=schema))
    entries, size = manager.cache_stats()
    assert entries == 2 and size <= manager.max_cache_bytes, (entries, size, one)
    compiled(manager, StructuredOutputsParams(json=schemas[3]))  # the newest stayed
    assert manager.num_compiles == 4


def test_a_finished_compile_leaves_the_manager(manager: Any) -> None:
    # A compile the manager kept after it finished would keep the request's matcher alive
    # for as long as the engine runs.
    grammars = [compiled(manager, StructuredOutputsParams(json=SCHEMA)) for _ in range(3)]
    assert all(g is not None for g in grammars)
    # The manager forgets a compile in the future's done-callback, which runs on the
    # compile thread just after the result is set.
    deadline = time.monotonic() + 10
    while manager.request_census()["pending_compiles"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert manager.request_census() == {"pending_compiles": 0}


def test_failed_compile_is_reported_on_the_request(manager: Any) -> None:
    # Skipping the front end's validation (as a raw wire client could) fails in the core.
    request = StructuredOutputRequest(StructuredOutputsParams(regex="(", _backend="xgrammar"))
    manager.grammar_init(request)
    manager.wait_for_compiles(timeout=60)
    assert request.is_ready() and request.grammar is None
    assert "failed to compile" in (request.error or "")


def test_auto_prefers_xgrammar_and_falls_back_to_guidance() -> None:
    assert resolve_backend("auto", StructuredOutputsParams(json=SCHEMA)) == "xgrammar"
    lark = 'start: "a" b\nb: /[0-9]+/'
    assert resolve_backend("auto", StructuredOutputsParams(grammar=lark)) == "guidance"
    with pytest.raises(ValueError, match=r"structured_outputs\.regex"):
        resolve_backend("auto", StructuredOutputsParams(regex="(("))


def test_registry_names_and_unknown_backend() -> None:
    assert {"auto", "xgrammar", "guidance"} <= set(backend_names())
    with pytest.raises(ValueError, match="unknown"):
        get_backend_class("outlines")


def test_dict_schema_is_carried_as_json_text() -> None:
    import msgspec

    spec = StructuredOutputsParams(json=SCHEMA)
    assert spec.json == json.dumps(SCHEMA)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(spec), type=StructuredOutputsParams)
    assert decoded == spec and decoded.kind == "json"
