"""`kvserve bench quantization`: the agreement measure and argument checks (the model
runs themselves are what `make bench`-style invocations and docs/benchmarks.md report)."""

from __future__ import annotations

import argparse

import pytest

from kvserve.benchmarks import quant_accuracy


def test_agreement_counts_positions_identical_prompts_and_common_prefix() -> None:
    reference = [[1, 2, 3, 4], [5, 6, 7, 8]]
    got = [[1, 2, 3, 4], [5, 9, 7, 8]]
    a = quant_accuracy.agreement(reference, got)
    assert a["position_agreement"] == 7 / 8
    assert a["identical_prompts"] == 1
    assert a["mean_common_prefix"] == (4 + 1) / 2


def _args(**overrides: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    quant_accuracy.add_cli_args(parser)
    args = parser.parse_args([])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def test_run_rejects_unknown_methods_and_prompt_counts_before_loading_a_model() -> None:
    with pytest.raises(ValueError, match="unknown quantization"):
        quant_accuracy.run(_args(methods="gguf,int3"))
    with pytest.raises(ValueError, match="num-prompts"):
        quant_accuracy.run(_args(num_prompts=0))


def test_table_lists_every_method_and_mode() -> None:
    same = {"position_agreement": 1.0, "identical_prompts": 2, "mean_common_prefix": 4.0}
    results = {
        "prompts": 2,
        "tokens_per_prompt": 4,
        "gguf": {"single_stream": same, "batched": same, "teacher_forced": 0.975},
    }
    table = quant_accuracy.format_table(results)
    assert "gguf        single_stream     100.0%" in table
    assert "batched" in table
    assert table.splitlines()[-1].endswith("97.5%")


def test_table_adds_the_logprob_deltas_where_measured() -> None:
    same = {"position_agreement": 0.9, "identical_prompts": 1, "mean_common_prefix": 3.0}
    results = {
        "prompts": 2,
        "tokens_per_prompt": 4,
        "kv_cache_dtype": "int8",
        "none": {
            "single_stream": same,
            "batched": same,
            "teacher_forced": 0.99,
            "logprob_delta": {"mean": 0.0123, "max": 0.25},
        },
    }
    table = quant_accuracy.format_table(results)
    assert "KV cache int8" in table.splitlines()[0]
    assert table.splitlines()[-1].endswith("99.0%         0.0123/0.250")
