"""The hybrid KV cache on the real Gemma 3 270M (15 sliding-window layers, 3 global):
bounded window memory, prefix hits reconciled across groups, preemption, no leaks.

The engine and HF reference are the session's (tests/gemma3_fixtures.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvserve.core.windowed_kv_cache_managers import SlidingWindowManager
from kvserve.protocol.kv_cache_interface import (
    FullAttentionSpec,
    build_kv_cache_config,
    cdiv,
    max_tokens_per_request,
)
from kvserve.sampling_params import SamplingParams
from tests.gemma3_fixtures import GEMMA3_MAX_TOKENS, GEMMA3_WINDOW, Gemma3HFReference
from tests.reference import assert_no_leak

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def scheduler_of(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler


def long_prompt(prompts: list[list[int]], length: int) -> list[int]:
    """length tokens: the longest session prompt, its body repeated (BOS once)."""
    source = max(prompts, key=len)
    body = source[1:]
    return (source[:1] + body * (length // len(body) + 1))[:length]


def test_window_groups_stay_bounded_on_a_2000_token_request(
    gemma3_llm: Any, gemma3_prompts: list[list[int]], gemma3_reference: list[list[int]]
) -> None:
    config = gemma3_llm.llm_engine.engine_core.engine_core.kv_cache_config
    groups = config.kv_cache_groups
    assert [len(g.layer_names) for g in groups] == [3] * 6  # 3 global, 15 window layers
    assert len(config.kv_cache_tensors) == 3  # tensor i serves layer i of every group
    # Tokens one request can hold in this memory, against a full-attention group per layer.
    specs = {n: g.kv_cache_spec for g in groups for n in g.layer_names}
    first = groups[0].kv_cache_spec
    plain = FullAttentionSpec(
        block_size=first.block_size,
        num_kv_heads=first.num_kv_heads,
        head_size=first.head_size,
        dtype_size=first.dtype_size,
    )
    memory = config.num_blocks * config.bytes_per_block
    full_config = build_kv_cache_config(dict.fromkeys(specs, plain), memory)
    batched = scheduler_of(gemma3_llm).max_num_scheduled_tokens
    hybrid_tokens = max_tokens_per_request(config, batched)
    full_tokens = max_tokens_per_request(full_config, batched)
    print(f"\ntokens that fit in {memory >> 20} MiB: hybrid {hybrid_tokens}, one full group "
          f"per layer {full_tokens} ({hybrid_tokens / full_tokens:.1f}x)")  # fmt: skip
    assert hybrid_tokens >= 3 * full_tokens

    # The session's longest prompt (~2,000 tokens, four windows): HF's tokens for it are
    # the session's reference already.
    longest = max(range(len(gemma3_prompts)), key=lambda i: len(gemma3_prompts[i]))
    prompt = gemma3_prompts[longest]
    engine = gemma3_llm.llm_engine
    scheduler = scheduler_of(gemma3_llm)
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    windows = [m for m in managers if isinstance(m, SlidingWindowManager)]
    assert len(windows) == 5
    block_size = windows[0].block_size
    decode_bound = cdiv(GEMMA3_WINDOW, block_size) + 1
    step_bound = windows[0].kv_cache_spec.max_num_blocks(len(prompt) + 8, batched)
    engine.add_request("long", {"prompt_token_ids": prompt}, GREEDY)
    tokens: list[int] = []
    peak_decode = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens = list(output.outputs[0].token_ids)
        request = scheduler.requests.get("long")
        if request is None:
            continue
        live = [m.num_live_blocks("long") for m in windows]
        assert max(live) <= step_bound, live
        if request.num_computed_tokens > len(prompt):  # trimmed by a decode step
            peak_decode = max(peak_decode, *live)
            assert max(live) <= decode_bound, (request.num_computed_tokens, live)
    assert 0 < peak_decode <= decode_bound
    assert tokens == gemma3_reference[longest][: GREEDY.max_tokens]
    scheduler.kv_cache_manager.check_integrity()
    assert_no_leak(gemma3_llm)


def test_shared_1500_token_prefix_hits_every_group(
    gemma3_llm: Any, gemma3_prompts: list[list[int]], gemma3_hf: Gemma3HFReference
) -> None:
    prefix = long_prompt(gemma3_prompts, 1500)
    tokenizer = gemma3_llm.get_tokenizer()
    first = prefix + tokenizer.encode(" Which box is green?", add_special_tokens=False)
    second = prefix + tokenizer.encode(" Who checked item 12?", add_special_tokens=False)
    gemma3_llm.generate([{"prompt_token_ids": first}], GREEDY, use_tqdm=False)
    scheduler_of(gemma3_llm).kv_cache_manager.check_integrity()
    (output,) = gemma3_llm.generate([{"prompt_token_ids": second}], GREEDY, use_tqdm=False)
    block_size = scheduler_of(gemma3_llm).block_size
    # Every full block of the shared prefix: the global layers' whole chain and the
    # window layers' last 511 tokens before it are still cached.
    assert output.num_cached_tokens == 1500 // block_size * block_size
    assert list(output.outputs[0].token_ids) == gemma3_hf.greedy(second, 8)
    assert_no_leak(gemma3_llm)


def test_preemption_gives_the_same_tokens(
    gemma3_llm_factory: Callable[..., Any],
    gemma3_prompts: list[list[int]],
    gemma3_reference: list[list[int]],
) -> None:
    # Every prompt but the ~2,000-token one (its prefill alone cost more than the rest
    # of the batch): the ~1,200-token one crosses two windows. Room for it and a few
    # short ones (1,664 tokens for one request): the batch must preempt.
    longest = max(range(len(gemma3_prompts)), key=lambda i: len(gemma3_prompts[i]))
    picked = [i for i in range(len(gemma3_prompts)) if i != longest]
    prompts = [gemma3_prompts[i] for i in picked]
    assert max(len(p) for p in prompts) > 2 * GEMMA3_WINDOW
    llm = gemma3_llm_factory(max_num_batched_tokens=64, num_blocks_override=290)
    params = SamplingParams(temperature=0.0, max_tokens=GEMMA3_MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert scheduler_of(llm).num_preemptions > 0
    reference = [gemma3_reference[i] for i in picked]
    for prompt, output, expected in zip(prompts, outputs, reference, strict=True):
        assert list(output.outputs[0].token_ids) == expected, f"prompt of {len(prompt)} tokens"
    assert_no_leak(llm)
