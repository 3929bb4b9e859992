"""`kvserve bench peers` end to end at a tiny scale: kvserve and HF on the real model."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from kvserve.benchmarks import peers, peers_sweep
from kvserve.benchmarks.peers_rounds import combine_rounds
from kvserve.benchmarks.peers_workloads import WORKLOADS, EngineResult, make_requests


def test_workloads_are_deterministic_and_scaled() -> None:
    spec = WORKLOADS["a"].scaled(0.25)
    assert spec.num_requests == 8 and spec.prompt_len == (16, 64) and spec.output_len == (8, 32)
    assert WORKLOADS["c"].scaled(0.25).num_requests == 1
    first, again = (make_requests(spec, 1000, {0, 1}, seed=3) for _ in range(2))
    assert [r.prompt_token_ids for r in first] == [r.prompt_token_ids for r in again]
    for r in first:
        assert 16 <= len(r.prompt_token_ids) <= 64 and 8 <= r.output_len <= 32
        assert not {0, 1} & set(r.prompt_token_ids)
    assert peers.parse_scale("0.5,b=0.25") == {"a": 0.5, "b": 0.25, "c": 0.5, "e": 0.5}


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


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_sweep_table_plot_and_missing_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert peers_sweep.parse_levels("4,1,2,2") == [1, 2, 4]
    with pytest.raises(argparse.ArgumentTypeError):
        peers_sweep.parse_levels("0,2")
    runs = [
        EngineResult("kvserve", "a", 2.0, 100, 40, extra={"concurrency": 1}),
        EngineResult("kvserve", "a", 1.0, 100, 40, extra={"concurrency": 4}),
        EngineResult("hf", "a", 4.0, 100, 40, extra={"concurrency": 4}),
    ]
    sweep = peers_sweep.sweep_report(runs, [1, 4], "a", 5)
    assert sweep["output_tok_s"] == {"kvserve": [20.0, 40.0], "hf": [None, 10.0]}
    table = peers_sweep.format_sweep_table(sweep)
    assert "| engine | C=1 | C=4 |" in table and "| hf | - | 10.0 |" in table
    png = tmp_path / "sweep.png"
    peers_sweep.plot_sweep(sweep, "machine: test", str(png))
    assert png.read_bytes().startswith(PNG_SIGNATURE)

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import now fails
    with pytest.raises(SystemExit, match="pip install 'kvserve\\[bench\\]'"):
        peers_sweep.new_figure()
    parser = argparse.ArgumentParser()
    peers.add_cli_args(parser)
    with pytest.raises(SystemExit, match="give --sweep too"):
        peers.run_peers(parser.parse_args(["--plot", str(png)]))


@pytest.mark.slow
def test_peers_sweep_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    peers.add_cli_args(parser)
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    args = parser.parse_args(
        [
            "--sweep", "1,2", "--scale", "0.05", "--engines", "kvserve,hf",
            "--gemm-size", "256", "--kv-cache-memory", "64M", "--torch-threads", "1",
            "--output-json", str(out), "--plot", str(png), "--disable-tqdm",
        ]
    )  # fmt: skip
    import torch

    threads = torch.get_num_threads()
    try:
        assert peers.main(args) == 0
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    assert "| engine | C=1 | C=2 |" in printed and f"plot written to {png}" in printed

    sweep = json.loads(out.read_text())["sweep"]
    assert sweep["workload"] == "a" and sweep["concurrency"] == [1, 2]
    assert sweep["num_requests"] == 2
    assert set(sweep["output_tok_s"]) == {"kvserve", "hf"}
    for rates in sweep["output_tok_s"].values():
        assert len(rates) == 2 and all(x > 0 for x in rates)
    runs = sweep["runs"]
    assert sorted((r["engine"], r["concurrency"]) for r in runs) == [
        ("hf", 1), ("hf", 2), ("kvserve", 1), ("kvserve", 2),
    ]  # fmt: skip
    # Every engine produced exactly the requested tokens at every level.
    assert len({r["output_tokens"] for r in runs}) == 1
    assert all(r["ratio_to_kvserve"] > 0 for r in runs)
    assert png.read_bytes().startswith(PNG_SIGNATURE)


def test_llamacpp_probe_reports_a_failing_child(tmp_path: Path) -> None:
    from kvserve.benchmarks.peers_llamacpp import extra_buffer_types_run

    # A child that cannot load its model exits non-zero, as one killed by SIGILL does.
    assert extra_buffer_types_run(str(tmp_path / "missing.gguf"), 1) is False


def test_open_llamacpp_runs_with_or_without_extra_buffer_types() -> None:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is an optional extra")
    from kvserve.benchmarks.peers_llamacpp import open_llamacpp
    from kvserve.benchmarks.peers_workloads import PeerRequest
    from kvserve.transformers_utils.model_resolver import resolve_model

    notes: list[str] = []
    peer = open_llamacpp(resolve_model(None).path, 1, notes)
    assert peer is not None
    try:
        batched = peer.run("probe", [PeerRequest(list(range(100, 140)), 3)] * 2, 2, False)
        single = peer.run("probe", [PeerRequest(list(range(100, 110)), 3)], 1, False)
    finally:
        peer.close()
    assert batched.output_tokens == 6 and single.output_tokens == 3
    # Without the extra buffer types the note and the configs say so; where only single
    # tokens survive them, single-stream runs keep them.
    assert all("use_extra_bufts off" in n for n in notes)
    assert ("no extra buffer types" in batched.config) == bool(notes)
    assert ("1 token per llama_decode" in single.config) == (peer.single_stream is not None)


def test_rounds_report_the_median_round_and_same_round_ratios() -> None:
    def run(engine: str, elapsed: float) -> EngineResult:
        return EngineResult(engine, "c", elapsed, prompt_tokens=32, output_tokens=100)

    # Round 2 ran on a slow machine for everyone: same-round ratios stay put.
    rounds = [
        [run("kvserve-gguf-int8", 1.0), run("llamacpp", 1.25)],
        [run("kvserve-gguf-int8", 2.0), run("llamacpp", 2.4)],
        [run("kvserve-gguf-int8", 0.9), run("llamacpp", 1.17)],
    ]
    combined, notes = combine_rounds(rounds)
    by_engine = {r.engine: r for r in combined}
    assert by_engine["kvserve-gguf-int8"].output_tok_s == pytest.approx(100.0)
    assert by_engine["llamacpp"].output_tok_s == pytest.approx(80.0)
    assert by_engine["llamacpp"].extra["rounds_output_tok_s"] == [80.0, 41.67, 85.47]
    assert notes == [
        "workload c: kvserve-gguf-int8 / llamacpp output tok/s, same-round ratio over 3 rounds: "
        "median 1.25 (min 1.20, max 1.30)"
    ]
    single, no_notes = combine_rounds(rounds[:1])
    assert len(single) == 2 and no_notes == []


@pytest.mark.parametrize(
    ("flags", "message"),
    [(["--rounds", "0"], "at least 1"), (["--rounds", "2", "--sweep", "1,2"], "--sweep runs once")],
)
def test_rounds_are_checked_before_any_engine_runs(flags: list[str], message: str) -> None:
    parser = argparse.ArgumentParser()
    peers.add_cli_args(parser)
    with pytest.raises(SystemExit, match=message):
        peers.run_peers(parser.parse_args(flags))
