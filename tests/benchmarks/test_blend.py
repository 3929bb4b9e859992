"""`kvserve bench blend` on a tiny random Llama: ratio 1.0 is exactly full prefill (every
token, zero KL), every document of a prompt is a segment hit, the table prints."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvserve.benchmarks import blend
from tests.worker.test_blend import VOCAB, build_tiny_llama


def _args(**overrides: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    blend.add_cli_args(parser)
    args = parser.parse_args([])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def test_kl_divergence_of_equal_and_shifted_distributions() -> None:
    p = {0: -0.5, 1: -0.9}
    assert blend.kl_divergence(p, p) == 0.0
    assert blend.kl_divergence(p, {0: -0.9, 1: -0.5}) > 0


def test_bad_arguments_fail_before_loading_a_model() -> None:
    with pytest.raises(ValueError, match="--ratios"):
        blend.run(_args(ratios="0,1.5"))
    with pytest.raises(ValueError, match="--docs-per-prompt"):
        blend.run(_args(pool=2, docs_per_prompt=3))


def test_bench_on_a_tiny_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    build_tiny_llama(tmp_path)
    args = _args(
        model=str(tmp_path), separator_ids="3,4", vocab_size=VOCAB, pool=4,
        min_doc_tokens=40, max_doc_tokens=80, num_prompts=3, ratios="0.15,1",
        gen_tokens=8, kv_cache_memory=16 << 20,
    )  # fmt: skip
    results = blend.run(args)
    full = results["blend_1"]
    assert full["token_match_rate"] == 1.0 and full["first_token_kl"] == 0.0
    assert results["blend_1"]["tokens"] == results["full_prefill"]["tokens"]
    # System text + 3 documents per prompt, all stored by the warm-up.
    assert results["blend_0.15"]["segment_hits"] == 4 * 3
    assert results["blend_0.15"]["segment_misses"] == 0
    print(blend.table(results))
    assert "blend_0.15" in capsys.readouterr().out
