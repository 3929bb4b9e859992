"""Grammar-constrained generation on SmolLM2-135M: JSON schemas, regexes and choices give
valid outputs, and greedy output equals HF transformers' greedy decoding under the same
xgrammar mask (built here with xgrammar's own matcher, independently of kvserve)."""

from __future__ import annotations

import functools
import importlib.metadata
import json
import re
from typing import Any

import jsonschema
import pytest
import torch
import xgrammar as xgr

from kvserve.sampling_params import SamplingParams, StructuredOutputsParams
from tests.reference import assert_no_leak, hf_reference

pytestmark = pytest.mark.slow

_STR = {"type": "string", "maxLength": 16}
SCHEMAS: list[dict[str, Any]] = [
    {  # flat, required fields, bounded integer
        "type": "object",
        "properties": {"name": _STR, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
    },
    {  # nested object
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 1}, "email": _STR},
                "required": ["id", "email"],
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
    },
    {  # array of strings
        "type": "object",
        "properties": {"tags": {"type": "array", "items": _STR, "minItems": 1, "maxItems": 3}},
        "required": ["tags"],
    },
    {  # enums
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L"]},
        },
        "required": ["color", "size"],
    },
    {  # numbers with bounds
        "type": "object",
        "properties": {
            "temperature": {"type": "number", "minimum": -50, "maximum": 60},
            "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
        },
        "required": ["temperature", "humidity"],
    },
    {  # array of objects
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {"name": _STR, "qty": {"type": "integer", "minimum": 1}},
                    "required": ["name", "qty"],
                },
            }
        },
        "required": ["items"],
    },
    {  # deep nesting
        "type": "object",
        "properties": {
            "meta": {
                "type": "object",
                "properties": {
                    "version": {"type": "integer", "minimum": 1, "maximum": 9},
                    "flags": {
                        "type": "object",
                        "properties": {"beta": {"type": "boolean"}},
                        "required": ["beta"],
                    },
                },
                "required": ["version", "flags"],
            }
        },
        "required": ["meta"],
    },
    {  # an optional field beside required ones
        "type": "object",
        "properties": {
            "title": _STR,
            "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
            "rating": {"type": "number", "minimum": 0, "maximum": 10},
        },
        "required": ["title", "year"],
    },
]
SUBJECTS = ["a person", "a user account", "a blog post's tags", "a T-shirt", "the weather",
            "a shopping cart", "a software release", "a film"]  # fmt: skip
REGEXES = [r"\d{3}-\d{3}-\d{4}", r"(yes|no)", r"[A-Z][a-z]{2,8}"]
CHOICES = ["Paris", "London", "Berlin", "Madrid"]
MAX_TOKENS = 100


def chat_ids(llm: Any, text: str) -> list[int]:
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer.encode(prompt, add_special_tokens=False))


def greedy(spec: StructuredOutputsParams, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=spec)


@functools.lru_cache(maxsize=1)
def hf_grammar_compiler() -> xgr.GrammarCompiler:
    """xgrammar over the HF reference's own tokenizer (not kvserve's)."""
    hf = hf_reference()
    vocab_size = hf.model.config.vocab_size
    return xgr.GrammarCompiler(
        xgr.TokenizerInfo.from_huggingface(hf.tokenizer, vocab_size=vocab_size)
    )


def hf_masked_greedy(prompt_ids: list[int], grammar: tuple[str, str], max_tokens: int) -> list[int]:
    """HF's greedy decoding with each step's logits masked by xgrammar's matcher, under
    ``grammar`` (kind, source: "json" schema text, "regex" or "ebnf"). From the HF
    reference's token store when an earlier run (or the other xdist worker) computed them:
    its key holds the prompt, the grammar's source and xgrammar's version beside the
    model's and this file's code."""
    inputs = {
        "masked_greedy": prompt_ids,
        "grammar": list(grammar),
        "xgrammar": importlib.metadata.version("xgrammar"),
        "max_tokens": max_tokens,
    }
    return hf_reference().stored_tokens(
        __file__, inputs, lambda: _hf_masked_greedy(prompt_ids, _grammar(*grammar), max_tokens)
    )


def _grammar(kind: str, source: str) -> xgr.Grammar:
    if kind == "json":
        return xgr.Grammar.from_json_schema(source, any_whitespace=False)
    if kind == "regex":
        return xgr.Grammar.from_regex(source)
    assert kind == "ebnf", kind
    return xgr.Grammar.from_ebnf(source)


@torch.inference_mode()
def _hf_masked_greedy(prompt_ids: list[int], grammar: xgr.Grammar, max_tokens: int) -> list[int]:
    hf = hf_reference()
    vocab_size = hf.model.config.vocab_size
    matcher = xgr.GrammarMatcher(hf_grammar_compiler().compile_grammar(grammar))
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    out = hf.model(torch.tensor([prompt_ids]), use_cache=True)
    tokens: list[int] = []
    while len(tokens) < max_tokens:
        logits = out.logits[0, -1:].float().clone()
        matcher.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        token = int(logits.argmax())
        tokens.append(token)
        assert matcher.accept_token(token)
        if matcher.is_terminated():
            break
        out = hf.model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def test_json_schemas_validate_and_match_hf_masked_greedy(llm: Any) -> None:
    prompts = [
        {"prompt_token_ids": chat_ids(llm, f"Describe {s} as a JSON object.")} for s in SUBJECTS
    ]
    # Compact JSON (no free whitespace): short outputs keep the HF reference cheap.
    params = [
        greedy(StructuredOutputsParams(json=schema, disable_any_whitespace=True))
        for schema in SCHEMAS
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for schema, prompt, output in zip(SCHEMAS, prompts, outputs, strict=True):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), schema)
        grammar = ("json", json.dumps(schema))
        expected = hf_masked_greedy(prompt["prompt_token_ids"], grammar, MAX_TOKENS)
        assert list(completion.token_ids) == expected, completion.text
    assert_no_leak(llm)


def test_regex_and_choice_match_and_equal_hf(llm: Any) -> None:
    texts = ["Give a US phone number.", "Answer yes or no: is the sky blue?", "Name a planet."]
    prompts = [{"prompt_token_ids": chat_ids(llm, t)} for t in texts]
    prompts.append({"prompt_token_ids": chat_ids(llm, "What is the capital of France?")})
    specs = [StructuredOutputsParams(regex=r) for r in REGEXES]
    specs.append(StructuredOutputsParams(choice=CHOICES))
    outputs = llm.generate(prompts, [greedy(s, 40) for s in specs], use_tqdm=False)
    for regex, output in zip(REGEXES, outputs, strict=False):
        assert re.fullmatch(regex, output.outputs[0].text), output.outputs[0].text
    assert outputs[-1].outputs[0].text in CHOICES
    grammars = [("regex", r) for r in REGEXES]
    grammars.append(("ebnf", "root ::= " + " | ".join(json.dumps(c) for c in CHOICES)))
    for prompt, grammar, output in zip(prompts, grammars, outputs, strict=True):
        expected = hf_masked_greedy(prompt["prompt_token_ids"], grammar, 40)
        assert list(output.outputs[0].token_ids) == expected


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_both_backends_sample_valid_outputs_with_n(llm: Any, backend: str) -> None:
    """Random sampling, n > 1: every sample is valid (each child has its own matcher)."""
    # Closed: llguidance lets random sampling add properties of free text, which ran past
    # max_tokens on some CPUs' numerics. Compact: free whitespace may pad past it too.
    schema = {**SCHEMAS[3], "additionalProperties": False}
    spec = StructuredOutputsParams(json=schema, disable_any_whitespace=True, _backend=backend)
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=80, structured_outputs=spec)
    [output] = llm.generate(
        [{"prompt_token_ids": chat_ids(llm, "Describe a T-shirt as JSON.")}], params, use_tqdm=False
    )
    assert len(output.outputs) == 4
    for completion in output.outputs:
        jsonschema.validate(json.loads(completion.text), schema)
    regex = StructuredOutputsParams(regex=REGEXES[0], _backend=backend)
    [output] = llm.generate(
        ["Call me at "], SamplingParams(n=3, seed=1, max_tokens=20, structured_outputs=regex),
        use_tqdm=False,
    )  # fmt: skip
    assert all(re.fullmatch(REGEXES[0], c.text) for c in output.outputs)


def test_same_output_with_prefix_cache_hits(llm: Any) -> None:
    prompt = {"prompt_token_ids": chat_ids(llm, "Describe the weather as JSON, briefly.")}
    params = greedy(StructuredOutputsParams(json=SCHEMAS[4]), 80)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    second = llm.generate([prompt], params, use_tqdm=False)[0]
    assert second.num_cached_tokens > 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    manager = llm.llm_engine.engine_core.engine_core.structured_output_manager
    compiles = manager.num_compiles
    llm.generate([prompt], params, use_tqdm=False)
    assert manager.num_compiles == compiles, "the same spec compiled twice"


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ({"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, "nonsense"),
        ({"regex": "(unclosed"}, "regex"),
        ({"grammar": "root ::= undefined_rule"}, "grammar"),
        ({"choice": []}, "choice"),
    ],
)
def test_invalid_spec_is_a_value_error_and_engine_keeps_serving(
    llm: Any, spec: dict[str, Any], problem: str
) -> None:
    with pytest.raises(ValueError, match="structured_outputs") as info:
        llm.generate(["Hi"], SamplingParams(structured_outputs=StructuredOutputsParams(**spec)))
    assert problem in str(info.value)
    [output] = llm.generate(["Hi"], SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 4
    assert_no_leak(llm)


def test_exactly_one_constraint() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
