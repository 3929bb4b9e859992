"""The draft-model proposer on a tiny random Llama: with the target itself as the draft,
every draft is accepted (its own paged KV cache is kept exactly in step with the
target's, through chunked prefill and prefix-cache hits), and outputs equal plain greedy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvserve.entrypoints.llm import LLM
from kvserve.sampling_params import SamplingParams
from tests.entrypoints.test_llm_tiny_models import CORPUS, build_model
from tests.reference import assert_no_leak


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    directory = tmp_path_factory.mktemp("tiny-llama-draft")
    return directory, build_model("llama", directory)


def test_the_target_as_its_own_draft_is_always_accepted(tiny: tuple[Path, Any]) -> None:
    directory, _ = tiny
    common: dict[str, Any] = dict(kv_cache_memory=32 << 20, max_num_batched_tokens=32)
    plain = LLM(str(directory), **common)
    draft = {"method": "draft_model", "model": str(directory), "num_speculative_tokens": 3}
    spec = LLM(str(directory), speculative_config=json.dumps(draft), **common)
    try:
        tokenizer = plain.get_tokenizer()
        prompts = [
            {"prompt_token_ids": tokenizer.encode(" ".join(CORPUS[i : i + 3]))} for i in range(4)
        ]
        params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
        for _ in range(2):  # the second round hits the prefix cache
            got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
            assert got == want
        stats = spec.llm_engine.engine_core.engine_core.scheduler.spec_decode.spec_decoding_stats
        assert stats.num_drafts > 0
        assert stats.num_accepted_tokens == stats.num_draft_tokens
        assert_no_leak(spec)
    finally:
        plain.llm_engine.shutdown()
        spec.llm_engine.shutdown()
