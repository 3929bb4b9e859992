"""StreamingLLM sink mode on the real SmolLM2: generation runs past max_model_len, each
request's KV stays within the sinks plus the window, and the tokens equal a reference
sink implementation on HF transformers' model (same weights, an explicit 4-D mask)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvserve.protocol.kv_cache_interface import SinkFullAttentionSpec, cdiv
from kvserve.sampling_params import SamplingParams
from tests.reference import assert_no_leak, hf_reference

CONTEXT = 32  # max_model_len: sinks + window
SINKS = 4
NEW_TOKENS = 72  # with the short prompts the sequences end past twice the context


def sink_mask(query_positions: range, num_keys: int, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, Q, K] additive mask: key k is visible from query q iff k <= q and
    (k > q - window or k < SINKS), with absolute positions (the engine's rule)."""
    window = CONTEXT - SINKS
    q = torch.tensor(list(query_positions))[:, None]
    k = torch.arange(num_keys)[None, :]
    visible = (k <= q) & ((k > q - window) | (k < SINKS))
    mask = torch.zeros(visible.shape, dtype=dtype)
    mask[~visible] = torch.finfo(dtype).min
    return mask[None, None]


@torch.inference_mode()
def reference_sink_greedy(prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy decoding of HF's Llama with the sink mask: keys never leave HF's cache, the
    mask hides them, so the model sees exactly what the engine keeps."""
    model = hf_reference().model
    dtype = torch.float32
    out = model(
        torch.tensor([prompt]),
        attention_mask=sink_mask(range(len(prompt)), len(prompt), dtype),
        use_cache=True,
    )
    tokens: list[int] = []
    while True:
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        if len(tokens) == max_tokens:
            return tokens
        position = len(prompt) + len(tokens) - 1
        out = model(
            torch.tensor([[token]]),
            attention_mask=sink_mask(range(position, position + 1), position + 1, dtype),
            past_key_values=out.past_key_values,
            position_ids=torch.tensor([[position]]),
            use_cache=True,
        )


@pytest.fixture(scope="module")
def sink_llm(llm_factory: Callable[..., Any]) -> Any:
    return llm_factory(max_model_len=CONTEXT, attention_sinks=SINKS, max_num_batched_tokens=32)


def test_generation_runs_past_the_context_and_matches_the_reference(sink_llm: Any) -> None:
    tokenizer = sink_llm.get_tokenizer()
    prompts = [
        "The history of the printing press begins",
        "List every prime number you know, one per line:",
    ]
    prompt_ids = [tokenizer.encode(p) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    engine = sink_llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    spec = scheduler.kv_cache_manager.kv_cache_config.kv_cache_groups[0].kv_cache_spec
    assert isinstance(spec, SinkFullAttentionSpec)
    bound = spec.num_sink_blocks + cdiv(spec.sliding_window, spec.block_size) + 1
    for i, ids in enumerate(prompt_ids):
        engine.add_request(f"sink-{i}", {"prompt_token_ids": ids}, params)
    outputs: dict[str, list[int]] = {}
    peak = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = list(output.outputs[0].token_ids)
        for manager in scheduler.kv_cache_manager.coordinator.single_type_managers:
            for request_id in manager.req_to_blocks:
                peak = max(peak, manager.num_live_blocks(request_id))
    assert peak <= bound, f"a request held {peak} blocks, more than sinks + window ({bound})"
    for i, ids in enumerate(prompt_ids):
        got = outputs[f"sink-{i}"]
        assert len(ids) + len(got) > 2 * CONTEXT
        want = hf_reference().stored_tokens(
            __file__,
            {"sink_greedy": ids, "max_tokens": NEW_TOKENS},
            functools.partial(reference_sink_greedy, ids, NEW_TOKENS),
        )
        assert got == want, f"prompt {i} diverged"
    assert_no_leak(sink_llm)


def test_sink_mode_is_validated() -> None:
    from kvserve.args.engine_args import EngineArgs

    with pytest.raises(ValueError, match="attention_sinks"):
        EngineArgs(max_model_len=CONTEXT, attention_sinks=CONTEXT).create_engine_config()
    with pytest.raises(ValueError, match="attention_sinks"):
        EngineArgs(attention_sinks=-1).create_engine_config()
