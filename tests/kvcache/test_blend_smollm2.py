"""CacheBlend on SmolLM2 (the packaged model): held-back RAG prompts, whose documents the
tier holds from other prompts in other orders, keep full prefill's first token on most
prompts at the default ratio; ratio 1.0 is exactly full prefill."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

import pytest

from kvserve.benchmarks.kvcache import make_document_ids
from kvserve.sampling_params import SamplingParams
from tests.reference import assert_no_leak

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
BLEND = json.dumps(
    {"kv_connector": "TieredCacheConnector", "kv_connector_extra_config": {"enable_blending": True}}
)


def _ask(llm: Any, ids: list[int], **kv: Any) -> list[int]:
    params = GREEDY.clone()
    params.extra_args = {"kv_transfer_params": kv}
    out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids)


def test_held_back_rag_prompts(llm_factory: Callable[..., Any]) -> None:
    llm = llm_factory(kv_transfer_config=BLEND, enable_prefix_caching=False)
    tokenizer = llm.get_tokenizer()
    sep = tokenizer.encode(" # # ", add_special_tokens=False)
    system = tokenizer.encode("Answer from the documents.", add_special_tokens=False)
    rng = random.Random(5)
    docs = [make_document_ids(tokenizer, rng.randint(100, 160), seed=40 + i) for i in range(4)]
    for doc in docs:  # the store: each document alone after the system text
        _ask(llm, [*system, *sep, *doc, *sep])

    def prompt(chosen: list[list[int]], question: str) -> list[int]:
        ids = list(system)
        for doc in chosen:
            ids += [*sep, *doc]
        return [*ids, *sep, *tokenizer.encode(question, add_special_tokens=False)]

    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner
    stats = runner.blend_runner.stats
    hits = stats.segment_hits
    matches, prompts = 0, 4
    for i in range(prompts):
        ids = prompt(rng.sample(docs, 3), f"Question {i}: which place comes first?")
        full = _ask(llm, ids, blend=False)
        matches += _ask(llm, ids)[0] == full[0]
        if i == 0:
            assert _ask(llm, ids, blend_recompute_ratio=1.0) == full
    assert stats.segment_hits - hits == 4 * prompts + 4  # system + 3 documents each
    assert matches >= 3, f"{matches}/{prompts} first tokens match full prefill"
    assert_no_leak(llm)
