"""TP=2 on tiny random MoE checkpoints: each rank holds half of every expert's
intermediate dim (FusedMoE all-reduces its partial sums) and half the heads; greedy
tokens equal transformers'. Qwen3-MoE also covers Qwen3's per-head q/k norms."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.entrypoints.llm import LLM
from kvserve.sampling_params import SamplingParams
from tests.family_models import build_family_model, hf_greedy

PROMPTS = [[5, 17, 99, 3, 42, 7], [100, 11, 64, 128, 9]]


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_tp2_moe_family_matches_transformers(tmp_path: Path, kind: str) -> None:
    hf = build_family_model(kind, tmp_path)
    llm = LLM(
        str(tmp_path), skip_tokenizer_init=True, tensor_parallel_size=2, block_size=4,
        kv_cache_memory=4 << 20,
    )  # fmt: skip
    try:
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == [
            hf_greedy(hf, p, 10) for p in PROMPTS
        ]
    finally:
        llm.llm_engine.shutdown()


def test_families_without_tp_are_refused(tmp_path: Path) -> None:
    build_family_model("phi3", tmp_path)
    with pytest.raises(ValueError, match="Phi3ForCausalLM does not support tensor parallelism"):
        LLM(
            str(tmp_path), skip_tokenizer_init=True, tensor_parallel_size=2, kv_cache_memory=4 << 20
        )
