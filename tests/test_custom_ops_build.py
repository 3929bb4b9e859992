"""How the C++ kernels' build fails: why the kernels are unavailable (so that a compile
error fails the kernel tests instead of skipping them), and a build lock left by a killed
builder, which must not hang the next process.

Builds run in subprocesses with their own TORCH_EXTENSIONS_DIR, from a one-file copy of
the sources, so this process's loaded extension and its cache are not touched."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvserve import kernel_build

# Self-contained (its own TORCH_LIBRARY_FRAGMENT) and the smallest source.
_ONE_SOURCE = kernel_build.CSRC / "memory_probe.cpp"

_PROBE = """
import json, logging, sys
from pathlib import Path
logging.basicConfig(level=logging.WARNING)
from kvserve import kernel_build
why = kernel_build.load([Path(p) for p in sys.argv[1:]])
print(json.dumps(None if why is None else [why.reason.value, why.detail]))
"""

needs_compiler = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler on PATH"
)


def _env(extensions: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != kernel_build.ENV_DISABLE}
    env["TORCH_EXTENSIONS_DIR"] = str(extensions)
    # This checkout's kvserve, whichever one the venv's editable install points at.
    root = str(Path(kernel_build.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def _probe_command(sources: list[Path]) -> list[str]:
    return [sys.executable, "-c", _PROBE, *map(str, sources)]


def _result(stdout: str) -> list[str] | None:
    return json.loads(stdout.strip().splitlines()[-1])


@needs_compiler
def test_a_compile_error_is_a_failed_build_with_the_compilers_message(tmp_path: Path) -> None:
    broken = tmp_path / _ONE_SOURCE.name
    source = _ONE_SOURCE.read_text()
    # Inside the namespace, after the includes: a typo as a person would make it.
    at = source.index("namespace kvserve_cpu {")
    broken.write_text(source[:at] + "int kvserve_broken( = ;\n" + source[at:])
    done = subprocess.run(
        _probe_command([broken]),
        env=_env(tmp_path / "extensions"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    result = _result(done.stdout)
    assert result is not None, done.stderr
    reason, detail = result
    assert reason == kernel_build.Reason.BUILD_FAILED.value
    error = f"{broken}:{source[:at].count(chr(10)) + 1}:"  # file:line: of the typo
    assert error in detail and "error:" in detail
    # The log names the failure and its first errors, not only "unavailable".
    assert "failed to build" in done.stderr
    assert any(error in line and "error:" in line for line in done.stderr.splitlines())
    # The failed build's lock was released: the directory is free for the next try.
    assert not (tmp_path / "extensions" / kernel_build.library_name() / "lock").exists()


@pytest.mark.parametrize("where", ["CXX names a missing binary", "PATH has no compiler"])
def test_a_missing_compiler_is_told_apart_from_a_failed_build(
    where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # No library is built or loaded on this path: it is safe in this process.
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # no stamped library there
    monkeypatch.delenv(kernel_build.ENV_DISABLE, raising=False)
    if where.startswith("CXX"):
        monkeypatch.setenv("CXX", str(tmp_path / "bin" / "c++"))
    else:
        monkeypatch.delenv("CXX", raising=False)
        monkeypatch.setenv("PATH", str(tmp_path))
    why = kernel_build.load(kernel_build.SOURCES)
    assert why is not None and why.reason is kernel_build.Reason.NO_COMPILER
    assert "not on PATH" in why.detail
    assert any("unavailable" in r.getMessage() for r in caplog.records)


def test_disabled_kernels_say_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernel_build.ENV_DISABLE, "1")
    why = kernel_build.load(kernel_build.SOURCES)
    assert why is not None and why.reason is kernel_build.Reason.DISABLED


@needs_compiler
def test_a_lock_left_by_a_killed_builder_does_not_hang_the_next_one(tmp_path: Path) -> None:
    source = tmp_path / _ONE_SOURCE.name
    shutil.copy(_ONE_SOURCE, source)
    env = _env(tmp_path / "extensions")
    lock = tmp_path / "extensions" / kernel_build.library_name() / "lock"
    # Its own session, so that the kill takes its ninja and compiler along, as a killed
    # terminal or container would.
    builder = subprocess.Popen(
        _probe_command([source]),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not lock.exists() and builder.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert lock.exists(), "the builder never took torch's build lock"
    finally:
        os.killpg(builder.pid, signal.SIGKILL)
        builder.wait()
    assert lock.exists()  # left behind: before, every later build waited on it forever
    done = subprocess.run(
        _probe_command([source]), env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert _result(done.stdout) is None, done.stderr  # built and loaded
    assert "removing the stale build lock" in done.stderr
    assert not lock.exists()
