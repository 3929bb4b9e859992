"""`kvserve bench long-context`: its plumbing at a tiny context, and the GGUF copy that
raises a model's context length."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from kvserve.benchmarks.cli import add_bench_parser
from kvserve.benchmarks.long_context import LLAMACPP_MISSING
from kvserve.benchmarks.long_context_gguf import context_length, gguf_with_context
from kvserve.benchmarks.peers_llamacpp import llama_cpp_available
from kvserve.transformers_utils.gguf_reader import open_gguf


def _tiny_gguf(path: Path) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.arange(64, dtype=np.float32).reshape(8, 8))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_copy_raises_the_context_length_and_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    original = str(tmp_path / "tiny.gguf")
    _tiny_gguf(Path(original))
    assert gguf_with_context(original, 100) == original  # already long enough
    copy = gguf_with_context(original, 40000)
    assert Path(copy).parent == tmp_path / "cache" / "kvserve" / "long_context"
    assert context_length(copy) == 40000 and context_length(original) == 128
    assert gguf_with_context(original, 40000) == copy  # made once
    a, b = Path(original).read_bytes(), Path(copy).read_bytes()
    assert len(a) == len(b) and sum(x != y for x, y in zip(a, b, strict=True)) <= 2
    assert np.array_equal(open_gguf(copy).tensors[0].data, open_gguf(original).tensors[0].data)


@pytest.mark.slow
def test_bench_long_context_prints_and_saves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    out = tmp_path / "long.json"
    args = parser.parse_args(
        ["bench", "long-context", "--contexts", "40", "--streams", "1,2", "--output-len", "3",
         "--torch-threads", "2", "--output-json", str(out)]
    )  # fmt: skip
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert [(r["context"], r["streams"]) for r in report["results"]] == [(40, 1), (40, 2)]
    for row in report["results"]:
        assert row["kvserve"]["decode_steps"] == 3  # every decode step after the prefill
        assert row["kvserve"]["decode_tok_s"] > 0
        assert row["split_k_partitions"] == 1  # 40 tokens: too short to split
        if llama_cpp_available():
            assert row["llamacpp"]["decode_steps"] == 3 and row["ratio"] > 0
    if not llama_cpp_available():
        assert LLAMACPP_MISSING in printed and LLAMACPP_MISSING in report["notes"]
    assert "decode tok/s after a prefill" in printed
