"""The GPU check (tools/gpu_check.sh): its dry mode on this CPU machine, and the
device-independent pieces of its benchmark's shape."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from kvserve.benchmarks.cli import add_bench_parser
from kvserve.benchmarks.datasets import _length_range
from kvserve.benchmarks.gpu_check import cuda_test_files
from kvserve.benchmarks.gpu_check_runs import (
    NANO_VLLM_MEAN_LEN,
    NANO_VLLM_RANGE_RATIO,
    matching_prefix,
    nano_vllm_throughput_args,
)

ROOT = Path(__file__).resolve().parents[2]


def test_dry_mode_reports_no_cuda_device_and_exits_0(tmp_path: Path) -> None:
    """No GPU visible: the script imports the GPU parts, writes its file and exits 0."""
    out = tmp_path / "results.md"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PY": sys.executable}
    proc = subprocess.run(
        ["bash", str(ROOT / "tools" / "gpu_check.sh"), "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device" in proc.stdout
    report = out.read_text()
    assert "Device: no CUDA device" in report
    assert "tests/attention/test_triton_attn_cuda.py" in report


def test_cuda_test_files_are_the_cuda_only_modules() -> None:
    files = cuda_test_files(ROOT)
    assert "tests/attention/test_triton_attn_cuda.py" in files
    assert all(f.endswith("_cuda.py") for f in files)


def test_nano_vllm_lengths_are_100_to_1023() -> None:
    assert _length_range(NANO_VLLM_MEAN_LEN, NANO_VLLM_RANGE_RATIO) == (100, 1023)


def test_nano_vllm_args_parse_as_bench_throughput(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    args = parser.parse_args(
        nano_vllm_throughput_args(tmp_path / "model", "SmolLM2-135M-Instruct", tmp_path / "r.json")
    )
    assert args.num_prompts == 256 and args.max_num_seqs == 256
    # The cache must hold a sequence at its longest: 1023 prompt + 1023 output tokens.
    assert args.max_model_len >= 2 * 1023


def test_matching_prefix() -> None:
    assert matching_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert matching_prefix([1, 2, 3], [1, 5, 3]) == 1
    assert matching_prefix([], [4]) == 0
