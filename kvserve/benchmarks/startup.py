"""`kvserve bench startup`: how long kvserve takes to become usable, cold and warm.

Each target runs as a fresh process, as a user would start it, twice in a row: "cold"
with an empty kvserve cache directory of its own (the tokenizer is converted from the
GGUF file), then "warm" with the cache the cold run left (the second start on a
machine). The operating system's file cache is not dropped: cold means kvserve's own
caches are empty. ``--kvserve-path`` runs another checkout's kvserve (e.g. the commit
before a change) under the same harness.

- ``serve``: ``kvserve serve`` until ``GET /health`` answers 200.
- ``generate``: ``kvserve generate`` until its first output token is on stdout.
- ``llm``: ``LLM()`` in a fresh interpreter (import excluded, reported apart).

Besides the wall time, every run reports the CPU time its processes used until then
(user + system, all threads; steadier than the wall clock on a busy shared machine) and
the start-up phases its processes logged (``startup phase ...`` lines, see
``kvserve.utils.startup``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from kvserve.utils.startup import parse_phases
from kvserve.utils.threads import usable_cores, user_environment

TARGETS = ("serve", "generate", "llm")
# argv: model, engine flags (one shell-quoted string), as the CLI would parse them.
_LLM_SCRIPT = """
import argparse, dataclasses, json, logging, shlex, sys, time
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
t0 = time.perf_counter()
from kvserve.args.engine_args import EngineArgs
from kvserve.entrypoints.llm import LLM
try:
    from kvserve.transformers_utils.tokenizer import conversion_count
except ImportError:  # a kvserve from before the tokenizer cache
    def conversion_count(): return None
parser = argparse.ArgumentParser()
EngineArgs.add_cli_args(parser, with_model=False)
engine_args = EngineArgs.from_cli_args(parser.parse_args(shlex.split(sys.argv[2])))
kwargs = {f.name: getattr(engine_args, f.name) for f in dataclasses.fields(EngineArgs)}
kwargs.pop("model")
t1, c1 = time.perf_counter(), time.process_time()
llm = LLM(sys.argv[1], **kwargs)
t2, c2 = time.perf_counter(), time.process_time()
print(json.dumps({"import_s": t1 - t0, "llm_s": t2 - t1, "cpu_s": c2 - c1,
                  "conversions": conversion_count()}))
llm.llm_engine.shutdown()
"""


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument(
        "--targets", default=",".join(TARGETS), help=f"comma-separated subset of {TARGETS}"
    )
    parser.add_argument("--port", type=int, default=8765, help="port for the serve target")
    parser.add_argument(
        "--engine-args",
        default="",
        help="extra engine flags for every target, e.g. '--kv-cache-memory 128M'",
    )
    parser.add_argument(
        "--kvserve-path",
        default=None,
        help="directory holding the kvserve package to start (default: this one)",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="per run, seconds")
    parser.add_argument("--output-json", default=None)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvserve.entrypoints.cli", "--log-level", "INFO", *args]


def _cwd(args: argparse.Namespace) -> str | None:
    # `python -m` / `-c` put the working directory first on sys.path: start the
    # processes inside the checkout under test, or they import whatever kvserve is here.
    return str(Path(args.kvserve_path).resolve()) if args.kvserve_path else None


def _tree_cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system) used so far by a process and its children: on a busy
    shared machine a steadier measure of start-up work than the wall clock."""
    try:
        import psutil  # a benchmark dependency, not the server's
    except ImportError:
        return None
    total = 0.0
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def _stop(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _run_serve(args: argparse.Namespace, env: dict[str, str], log: Path) -> dict[str, Any]:
    cmd = _cli("serve", args.model, "--port", str(args.port), *shlex.split(args.engine_args))
    url = f"http://127.0.0.1:{args.port}/health"
    with log.open("w") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, cwd=_cwd(args), stdout=out, stderr=subprocess.STDOUT)
        try:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"kvserve serve exited ({proc.returncode}); log: {log}")
                if time.perf_counter() - start > args.timeout:
                    raise TimeoutError(f"kvserve serve not healthy in {args.timeout} s")
                try:
                    if httpx.get(url, timeout=1.0).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
            seconds = time.perf_counter() - start
            return {"seconds": seconds, "cpu_s": _tree_cpu_seconds(proc.pid)}
        finally:
            _stop(proc)


def _run_generate(args: argparse.Namespace, env: dict[str, str], log: Path) -> dict[str, Any]:
    cmd = _cli("generate", "What is the capital of France?", "--model", args.model)
    cmd += ["--max-tokens", "8", *shlex.split(args.engine_args)]
    with log.open("w") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, cwd=_cwd(args), stdout=subprocess.PIPE, stderr=err)
        assert proc.stdout is not None
        first: float | None = None
        cpu: float | None = None
        try:
            # The first non-blank character on stdout is the first generated token.
            while first is None:
                chunk = os.read(proc.stdout.fileno(), 4096)
                if not chunk:
                    raise RuntimeError(f"kvserve generate printed nothing; log: {log}")
                if chunk.strip():
                    first = time.perf_counter() - start
                    cpu = _tree_cpu_seconds(proc.pid)
            proc.stdout.read()
            if proc.wait(args.timeout) != 0:
                raise RuntimeError(f"kvserve generate exited {proc.returncode}; log: {log}")
        finally:
            _stop(proc)
    return {"seconds": first, "cpu_s": cpu}


def _run_llm(args: argparse.Namespace, env: dict[str, str], log: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-c", _LLM_SCRIPT, args.model, args.engine_args]
    with log.open("w") as err:
        done = subprocess.run(
            cmd,
            env=env,
            cwd=_cwd(args),
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            timeout=args.timeout,
        )
    if done.returncode != 0:
        raise RuntimeError(f"LLM() failed ({done.returncode}); log: {log}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {"seconds": result.pop("llm_s"), **result}


_RUNNERS = {"serve": _run_serve, "generate": _run_generate, "llm": _run_llm}


def run(args: argparse.Namespace) -> dict[str, Any]:
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown or not targets:
        raise ValueError(f"--targets: unknown {unknown} (choose from {', '.join(TARGETS)})")
    results: dict[str, Any] = {
        "cpu": _cpu_model(),
        "usable_cores": usable_cores(),
        "model": args.model,
        "engine_args": args.engine_args,
        "kvserve_path": args.kvserve_path,
        "runs": [],
    }
    # Each started process chooses its own thread settings, as it would for a user.
    env = user_environment()
    if args.kvserve_path:
        env["PYTHONPATH"] = str(Path(args.kvserve_path).resolve())
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-startup-") as scratch:
        for target in targets:
            env["KVSERVE_HOME"] = str(Path(scratch) / f"cache-{target}")
            for temperature in ("cold", "warm"):
                log = Path(scratch) / f"{target}-{temperature}.log"
                figures = _RUNNERS[target](args, env, log)
                figures["phases"] = parse_phases(log.read_text())
                results["runs"].append({"target": target, "start": temperature, **figures})
    return results


def _print(results: dict[str, Any]) -> None:
    print(f"CPU: {results['cpu']} ({results['usable_cores']} usable cores)")
    print(f"model: {results['model']}  engine args: {results['engine_args'] or '(defaults)'}")
    if results["kvserve_path"]:
        print(f"kvserve from: {results['kvserve_path']}")
    labels = {"serve": "serve -> healthy", "generate": "generate -> 1st token", "llm": "LLM()"}
    for run in results["runs"]:
        cpu = run.get("cpu_s")
        cpu_text = f"  (CPU {cpu:.2f} s)" if cpu is not None else ""
        print(f"{labels[run['target']]:>22} {run['start']:>4}: {run['seconds']:7.2f} s{cpu_text}")
        for name, seconds in run["phases"].items():
            print(f"{'':>30}{name}: {seconds:.3f} s")


def main(args: argparse.Namespace) -> int:
    results = run(args)
    _print(results)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=2))
    return 0
