"""Building and loading the C++ CPU kernels (kvserve/csrc/) with torch's cpp_extension,
for ``kvserve._custom_ops``, which decides when: compiled for this machine
(``-march=native``, or $KVSERVE_MARCH), cached under torch's extensions directory with a
stamp that lets the next process load the library without importing the build machinery,
serialised between processes by a lock the operating system drops with a dead builder.
``load`` says why the kernels cannot be had: disabled, no compiler, or a failed build
(with the compiler's output), so tests skip only for the first two.
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import os
import shutil
import sys
import sysconfig
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ENV_DISABLE = "KVSERVE_DISABLE_CUSTOM_OPS"
CSRC = Path(__file__).parent / "csrc"
SOURCES = [
    CSRC / name
    for name in (
        "cpu_ops.cpp",
        "decode_attention.cpp",
        "decode_attention_int8.cpp",
        "decode_attention_split.cpp",
        "block_gemm.cpp",
        "block_gemm_int8.cpp",
        "block_gemm_vnni.cpp",
        "block_gemm_exact.cpp",
        "block_gemm_packed_avx2.cpp",
        "greedy_screen.cpp",
        "decode_stack.cpp",
        "decode_step.cpp",
        "mamba_decode.cpp",
        "memory_probe.cpp",
        "shm_all_reduce.cpp",
    )
]
# KVSERVE_MARCH: build for another CPU than this one (e.g. "haswell", AVX2 without
# AVX-512), so the narrower kernels can be tested on a wider machine; each target is its
# own extension, cached side by side.
ENV_MARCH = "KVSERVE_MARCH"
_CFLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]


class Reason(enum.Enum):
    DISABLED = "disabled"  # by $KVSERVE_DISABLE_CUSTOM_OPS
    NO_COMPILER = "no compiler"  # $CXX (default c++) is not on PATH
    BUILD_FAILED = "build failed"  # compiling, linking or loading the library failed


@dataclass(frozen=True)
class Unavailable:
    """Why the kernels are not loaded; ``detail`` holds the compiler's output for a
    failed build."""

    reason: Reason
    detail: str


def _march() -> str:
    return os.environ.get(ENV_MARCH, "") or "native"


def library_name() -> str:
    """The extension's name for this process's target (one per ``KVSERVE_MARCH``)."""
    march = _march()
    suffix = "" if march == "native" else "_" + "".join(c if c.isalnum() else "_" for c in march)
    return "kvserve_cpu_ops" + suffix


class _NoCompiler(Exception):
    pass


def _build(sources: Sequence[Path]) -> None:
    # torch re-builds when the sources or flags change; headers only count through a flag.
    headers = b"".join(path.read_bytes() for path in sorted(CSRC.glob("*.h")))
    header_hash = hashlib.sha256(headers).hexdigest()[:16]
    march, name = _march(), library_name()
    cflags = [*_CFLAGS, f"-march={march}", f"-DKVSERVE_HEADERS={header_hash}"]
    stamp = _build_stamp(name, cflags, headers, sources)
    if _load_stamped(name, stamp):
        return
    # The venv's own ninja (a pip dependency) is found even when the venv is not activated.
    scripts = sysconfig.get_path("scripts")
    os.environ["PATH"] = os.pathsep.join([scripts, os.path.dirname(sys.executable)]) + (
        os.pathsep + os.environ.get("PATH", "")
    )
    # torch's own choice of compiler (cpp_extension.get_cxx_compiler on POSIX), looked up
    # before importing cpp_extension: its failure would read like any other build error.
    compiler = os.environ.get("CXX", "c++")
    if not compiler or shutil.which(compiler) is None:
        raise _NoCompiler(f"no C++ compiler: {compiler!r} (from $CXX, default c++) is not on PATH")
    with _build_lock(library_path(name).parent):
        if _load_stamped(name, stamp):  # built by the process this one waited for
            return
        from torch.utils import cpp_extension

        library = cpp_extension.load(
            name=name,
            sources=[str(path) for path in sources],
            extra_include_paths=[str(CSRC)],
            extra_cflags=cflags,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
        _write_stamp(Path(str(library)), stamp)


# torch's cpp_extension serialises builds with a bare file (FileBaton, "<build dir>/lock")
# that only its creator removes: a builder killed mid-build leaves it behind, and every
# later process waits on it forever. kvserve's builders also hold an flock on a file of
# their own, which the operating system drops when the holder dies, however it dies;
# whoever holds it knows that no kvserve process is building, so a baton it finds is a
# dead one's. (A builder that does not take the flock, an older kvserve sharing the
# extensions directory, could lose its baton this way, as could the ninja a killed builder
# left running: the cost is two ninja runs in one directory at once, not a hang.)
_FLOCK_NAME = "kvserve-build.flock"


@contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    import fcntl

    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / _FLOCK_NAME, "a") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)  # waits while a live process builds
        baton = build_dir / "lock"
        if baton.exists():
            logger.warning(
                "removing the stale build lock %s: the process that took it died mid-build "
                "(no live kvserve builder holds %s)",
                baton,
                holder.name,
            )
            baton.unlink(missing_ok=True)
        yield


# A library built by the slow path above is loaded straight from its build directory by
# later processes when a stamp beside it names the same sources, flags, torch and Python,
# and the library file is the one the stamp saw: importing torch's cpp_extension (it
# pulls in setuptools) and asking ninja cost every process ~0.3-0.6 s of its start.
_STAMP_SUFFIX = ".kvserve-build.json"


def _build_stamp(name: str, cflags: list[str], headers: bytes, sources: Sequence[Path]) -> str:
    digest = hashlib.sha256(headers)
    for path in sources:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    context = [name, *cflags, torch.__version__, sys.version, os.environ.get("CXX", "")]
    digest.update("\0".join(context).encode())
    return digest.hexdigest()


def library_path(name: str) -> Path:
    """Where torch's cpp_extension puts ``name``'s library (its _get_build_directory)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        import torch._appdirs

        version = torch.version
        if version.hip is not None:
            accelerator = "rocm" + version.hip.replace(".", "")
        elif version.cuda is not None:
            accelerator = "cu" + version.cuda.replace(".", "")
        else:
            accelerator = "cpu"
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        base = os.path.realpath(torch._appdirs.user_cache_dir(appname="torch_extensions"))
        root = os.path.join(base, f"{python}_{accelerator}")
    return Path(root) / name / f"{name}.so"


def _load_stamped(name: str, stamp: str) -> bool:
    library = library_path(name)
    try:
        recorded = json.loads(library.with_name(library.name + _STAMP_SUFFIX).read_text())
        info = library.stat()
    except (OSError, ValueError):
        return False
    if recorded != {"stamp": stamp, "size": info.st_size, "mtime_ns": info.st_mtime_ns}:
        return False
    torch.ops.load_library(str(library))
    return True


def _write_stamp(library: Path, stamp: str) -> None:
    try:
        info = library.stat()
        record = {"stamp": stamp, "size": info.st_size, "mtime_ns": info.st_mtime_ns}
        temporary = library.with_name(f"{library.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps(record))
        temporary.replace(library.with_name(library.name + _STAMP_SUFFIX))
    except OSError as exc:  # only the next start's speed depends on it
        logger.debug("could not stamp %s: %s", library, exc)


def load(sources: Sequence[Path]) -> Unavailable | None:
    """Build (or find built) and load the library of ``sources``; why not, if it fails."""
    if os.environ.get(ENV_DISABLE, "") not in ("", "0"):
        return Unavailable(Reason.DISABLED, f"${ENV_DISABLE} is set")
    try:
        _build(sources)
    except _NoCompiler as exc:  # the torch paths remain
        logger.warning("kvserve CPU kernels unavailable, using torch ops: %s", exc)
        return Unavailable(Reason.NO_COMPILER, str(exc))
    except Exception as exc:  # a compile or link error, a library that does not load
        detail = str(exc)
        logger.warning(
            "kvserve CPU kernels failed to build, using torch ops (slower):\n%s",
            first_errors(detail),
        )
        return Unavailable(Reason.BUILD_FAILED, detail)
    return None


def first_errors(output: str, lines: int = 12) -> str:
    """The lines of a build's output that name its errors, not the screens of context
    (compiler commands, "In file included from") that come between them."""
    head, *rest = output.splitlines() or [""]
    # torch's message starts "Error building extension 'name': " and runs on into ninja's
    # first compiler command, a line of include paths and flags.
    head = head.split(": ", 1)[0] if head.startswith("Error building extension") else head
    errors = [line for line in rest if "error" in line.lower()]
    return "\n".join([head, *(errors or rest)][:lines])
