"""`kvserve bench ubatch` on a tiny random Llama at TP=2: both engines give the same
tokens, only the DBO engine runs micro-batches, and every figure is reported (the times
are measured, never asserted)."""

from __future__ import annotations

import argparse

import pytest

from kvserve.benchmarks import ubatch

pytestmark = pytest.mark.slow  # two TP=2 engines


def _args(**overrides: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    ubatch.add_cli_args(parser)
    args = parser.parse_args(
        "--num-prompts 4 --prompt-len 12 --max-tokens 4 --rounds 1 --hidden-size 64 "
        "--num-layers 2 --vocab-size 256 --dbo-decode-token-threshold 2 "
        "--dbo-prefill-token-threshold 2".split()
    )
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def test_bench_ubatch_compares_engines_with_the_same_tokens() -> None:
    r = ubatch.run_ubatch(_args())
    assert r["tokens_identical"] and r["tensor_parallel_size"] == 2
    for workload in ("prefill", "decode"):
        w = r[workload]
        assert w["dbo"]["steps"] > 0 and w["dbo"]["steps"] == w["no_dbo"]["steps"]
        assert w["dbo"]["ubatched_steps"] > 0 and w["no_dbo"]["ubatched_steps"] == 0
        for name in ("dbo", "no_dbo"):
            assert w[name]["step_ms"] > 0 and w[name]["forward_ms"] > 0


def test_bench_ubatch_names_a_bad_argument() -> None:
    with pytest.raises(ValueError, match="rounds"):
        ubatch.run_ubatch(_args(rounds=0))
