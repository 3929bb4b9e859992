"""`kvserve bench peers` end to end at a tiny scale: kvserve and HF on the real model."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvserve.benchmarks import peers
from kvserve.benchmarks.peers_workloads import WORKLOADS, make_requests


def test_workloads_are_deterministic_and_scaled() -> None:
    spec = WORKLOADS["a"].scaled(0.25)
    assert spec.num_requests == 8 and spec.prompt_len == (16, 64) and spec.output_len == (8, 32)
    assert WORKLOADS["c"].scaled(0.25).num_requests == 1
    first, again = (make_requests(spec, 1000, {0, 1}, seed=3) for _ in range(2))
    assert [r.prompt_token_ids for r in first] == [r.prompt_token_ids for r in again]
    for r in first:
        assert 16 <= len(r.prompt_token_ids) <= 64 and 8 <= r.output_len <= 32
        assert not {0, 1} & set(r.prompt_token_ids)
    assert peers.parse_scale("0.5,b=0.25") == {"a": 0.5, "b": 0.25, "c": 0.5}


@pytest.mark.slow
def test_peers_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    peers.add_cli_args(parser)
    out = tmp_path / "peers.json"
    args = parser.parse_args(
        [
            "--workloads", "a", "--scale", "0.08", "--engines", "kvserve,hf",
            "--hf-batch-sizes", "1,2", "--gemm-size", "256", "--kv-cache-memory", "64M",
            "--torch-threads", "1",
            "--output-json", str(out), "--disable-tqdm",
        ]
    )  # fmt: skip
    import torch

    threads = torch.get_num_threads()
    try:
        assert peers.main(args) == 0
    finally:
        torch.set_num_threads(threads)  # the rest of the session keeps its thread count
    table = capsys.readouterr().out
    assert "machine: " in table and "| kvserve | a |" in table and "| hf | a |" in table

    report = json.loads(out.read_text())
    assert report["gemm_flops_per_s"] > 0 and report["machine"]["torch_threads"] >= 1
    by_engine = {r["engine"]: r for r in report["results"]}
    assert set(by_engine) == {"kvserve", "hf"}
    assert by_engine["kvserve"]["ratio_to_kvserve"] == pytest.approx(1.0)
    for r in report["results"]:
        assert r["output_tokens"] == by_engine["kvserve"]["output_tokens"] > 0
        assert r["output_tok_s"] > 0 and r["total_tok_s"] > r["output_tok_s"]
        assert 0 < r["flop_utilization"] and r["ratio_to_kvserve"] > 0
    # HF tried both batch sizes and reports its best.
    hf_tries = [t for t in report["tries"] if t["engine"] == "hf"]
    assert len(hf_tries) == 2
    assert by_engine["hf"]["output_tok_s"] == max(t["output_tok_s"] for t in hf_tries)
