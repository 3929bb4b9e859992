"""`kvserve bench peers`' single streams against the memory read bound, at a tiny size."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvserve.benchmarks import peers
from kvserve.benchmarks.peers_bandwidth import annotate_single_streams, weight_bytes_per_token
from kvserve.benchmarks.peers_workloads import EngineResult
from kvserve.benchmarks.random_gguf import LlamaShape, ensure_random_gguf

TINY = LlamaShape("tiny-llama", 64, 2, 4, 2, 128, 49152 + 64)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_random_gguf(TINY, tmp_path_factory.mktemp("random_gguf"))


def test_weight_bytes_count_every_tensor_once(tiny_gguf: Path) -> None:
    h, kv, i = 64, 2 * 16, 128
    q4_1 = 20 / 32  # bytes per weight
    layer = (2 * h * h + 2 * kv * h + 3 * h * i) * q4_1 + 2 * h * 4
    embedding = TINY.vocab_size * h * 34 / 32  # tied: read once, as the LM head
    expected = 2 * layer + embedding + h * 4 + 8 * 4  # + final norm and rope factors
    assert weight_bytes_per_token(str(tiny_gguf)) == expected


def test_single_streams_are_set_against_the_two_thread_rate() -> None:
    results = [
        EngineResult("kvserve", "c", 2.0, 32, 100),  # 50 tok/s
        EngineResult("kvserve", "a", 2.0, 320, 1000),
    ]
    notes = annotate_single_streams(results, {"c"}, 200_000_000, [8.0, 16.0])
    assert results[0].extra["weight_read_gb_s"] == pytest.approx(10.0)
    assert results[0].extra["read_bound_fraction"] == pytest.approx(10.0 / 16.0)
    assert "read_bound_fraction" not in results[1].extra
    assert notes == [
        "workload c, kvserve: 200 MB of weights per token x 50.0 tok/s = 10.0 GB/s, 62% of "
        "the 2-thread read bound (16.0 GB/s)"
    ]


@pytest.mark.slow  # two engines start, as the other end-to-end peers tests
def test_peers_reports_the_read_bound(
    tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    peers.add_cli_args(parser)
    out = tmp_path / "peers.json"
    args = parser.parse_args(
        [
            "--model", str(tiny_gguf), "--workloads", "c", "--scale", "0.05",
            "--engines", "kvserve,kvserve-gguf-int8", "--gemm-size", "128",
            "--kv-cache-memory", "4M", "--output-json", str(out), "--disable-tqdm",
        ]
    )  # fmt: skip
    assert peers.main(args) == 0
    printed = capsys.readouterr().out
    assert "on 4 KiB pages)" in printed and "-thread read bound (" in printed
    report = json.loads(out.read_text())
    for key in ("memory_read_gb_s", "memory_read_gb_s_after"):  # probed before and after
        rates = report["machine"][key]
        assert set(rates) == {"huge_pages", "4k_pages"}
        assert all(r > 0 for r in rates["huge_pages"] + rates["4k_pages"])
    assert {r["engine"] for r in report["results"]} == {"kvserve", "kvserve-gguf-int8"}
    for r in report["results"]:
        assert r["weight_bytes_per_token"] == weight_bytes_per_token(str(tiny_gguf))
        assert r["read_bound_fraction"] > 0


def test_random_gguf_flag_names_the_known_shapes() -> None:
    parser = argparse.ArgumentParser()
    peers.add_cli_args(parser)
    assert parser.parse_args(["--random-gguf", "llama-3.2-1b"]).random_gguf == "llama-3.2-1b"
    with pytest.raises(SystemExit):
        parser.parse_args(["--random-gguf", "llama-9000"])
