"""Mamba-2 models through ``LLM`` against HF transformers on the same tiny random
checkpoint: pure ``Mamba2ForCausalLM`` and the ``BambaForCausalLM`` and
``NemotronHForCausalLM`` hybrids (Mamba-2 + attention; NemotronH also has MLP-only layers
and attention without positions), ``FalconH1ForCausalLM`` (Mamba-2 beside attention
in every layer, muP multipliers) and ``GraniteMoeHybridForCausalLM`` (Bamba's layout with
routed experts and a shared MLP). Greedy tokens identical through batching, chunked prefill whose chunks
split the scan's chunks (16-token budget, scan chunks of 8), preemption by recompute
(the hybrid's attention blocks run short), aborts, and n-gram speculative decoding
(rejected drafts must not advance the state), and prefix caching (a prompt resumes
from the state cached at its last full block and computes only its tail; prefix
caching is on by default, "align" mode in core/mamba_manager.py). No KV block leaks."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from kvserve.entrypoints.llm import LLM
from kvserve.sampling_params import SamplingParams
from tests.distributed.kv_transfer.helpers import as_json, shared_storage
from tests.mamba_models import MAMBA_FAMILIES, build_mamba_model, hf_greedy
from tests.reference import assert_no_leak

MAX_TOKENS = 10
# Hybrids of two Mamba layers and one attention layer (the tiny configs).
HYBRIDS = ("bamba", "nemotron_h", "falcon_h1", "granitemoehybrid")


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (9, 23, 14, 30, 41)]
    # A prompt that repeats itself, so the n-gram proposer drafts; one that shares the
    # first 21 tokens of another (a prefix hit of 20 with 4-token blocks).
    return [*prompts, prompts[0] * 3, prompts[4][:21] + prompts[1]]


@pytest.fixture(scope="module", params=MAMBA_FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    kind = request.param
    path = tmp_path_factory.mktemp(kind)
    reference = build_mamba_model(kind, path)
    prompts = _prompts(reference.config.vocab_size)
    expected = [hf_greedy(reference, p, MAX_TOKENS) for p in prompts]
    return kind, str(path), prompts, expected


def _run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("caching", [True, False], ids=["align", "one_block"])
def test_greedy_matches_hf_through_batching_chunking_and_preemption(
    family: Any, caching: bool
) -> None:
    kind, path, prompts, expected = family
    # The hybrids' blocks are 32 tokens (an attention page holds a state): a request
    # holds 1-2 attention blocks and a state block per Mamba group (up to 5 with
    # prefix caching, core/mamba_manager.py), so these small pools preempt. A pure Mamba
    # request's blocks do not grow with it: it is never preempted for want of blocks.
    num_blocks = 14 if kind in HYBRIDS and caching else 8
    llm = LLM(
        path, skip_tokenizer_init=True, block_size=4, max_num_batched_tokens=16,
        num_blocks_override=num_blocks, enable_prefix_caching=caching,
    )  # fmt: skip
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    assert _run(llm, prompts) == expected
    # One at a time: no batching, the same tokens.
    assert _run(llm, [prompts[4]]) == [expected[4]]
    if kind in HYBRIDS:
        assert scheduler.num_preemptions > 0, "the small pool should have preempted"
    # An abort mid-prefill frees the request's state block and attention blocks.
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm.llm_engine.add_request("aborted", {"prompt_token_ids": prompts[4]}, params)
    llm.llm_engine.step()
    llm.llm_engine.abort_request(["aborted"])
    assert_no_leak(llm)
    llm.llm_engine.shutdown()


def test_ngram_speculation_keeps_the_state_exact(family: Any) -> None:
    _kind, path, prompts, expected = family
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    llm = LLM(
        path, skip_tokenizer_init=True, block_size=4, max_num_batched_tokens=16,
        speculative_config=json.dumps(spec),
    )  # fmt: skip
    assert _run(llm, prompts) == expected
    stats = llm.llm_engine.engine_core.engine_core.scheduler.spec_decode.spec_decoding_stats
    # Drafts were verified and some rejected: the states were put back.
    assert stats.num_drafts > 0
    assert stats.num_draft_tokens > stats.num_accepted_tokens
    assert_no_leak(llm)
    llm.llm_engine.shutdown()


def test_prefix_hit_resumes_from_the_cached_state(family: Any) -> None:
    _kind, path, prompts, expected = family
    llm = LLM(path, skip_tokenizer_init=True, block_size=4, max_num_batched_tokens=16)
    block_size = llm.llm_engine.engine_core.engine_core.scheduler.block_size
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompt = prompts[4]
    first = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    again = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    # Only the tail after the last cached block end was computed.
    assert again.num_cached_tokens == (len(prompt) - 1) // block_size * block_size > 0
    assert list(again.outputs[0].token_ids) == expected[4]
    # Another prompt sharing the first 21 tokens: align mode cached the state at the last
    # block end of each 16-token prefill chunk (16, then 28, ...), so it resumes from the
    # state after 16 (none with the hybrid's 32-token blocks), and gives HF's tokens.
    shared = llm.generate({"prompt_token_ids": prompts[6]}, params, use_tqdm=False)[0]
    assert shared.num_cached_tokens == (16 if block_size == 4 else 0)
    assert list(shared.outputs[0].token_ids) == expected[6]
    assert_no_leak(llm)
    llm.llm_engine.shutdown()


def test_unsupported_companions_are_refused(family: Any, tmp_path: Any) -> None:
    """A draft model (it would need its own states) and KV connectors (they move token
    blocks, not states) are refused at start-up, naming the field."""
    _kind, path, _prompts, _expected = family
    draft = json.dumps({"method": "draft_model", "model": path, "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="speculative_config"):
        LLM(path, skip_tokenizer_init=True, speculative_config=draft)
    with pytest.raises(ValueError, match="kv_transfer_config"):
        LLM(path, skip_tokenizer_init=True, kv_transfer_config=as_json(shared_storage(tmp_path)))
