#!/usr/bin/env bash
# The GPU check (docs/gpu.md): on a CUDA machine with nothing to download, the CUDA-only
# tests and a short benchmark, in under 8 minutes, into one results file. Without a CUDA
# device it reports "no CUDA device" and exits 0 (CI runs it so, for its imports).
#
#   tools/gpu_check.sh [--out FILE] [--dry-run]      (default FILE: gpu_check_results.md)
#
# PY names the interpreter (default: the repository's .venv, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
# 8 minutes in all; the results file is written part by part, so a cut-off run keeps
# what it measured. SIGINT first so pytest and the engines shut down their children.
exec timeout --signal=INT --kill-after=15 470 "$PY" -m kvserve.benchmarks.gpu_check "$@"
