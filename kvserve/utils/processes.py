"""kvserve's own child processes: the engine core (its client spawns it) and the TP/PP
workers (MultiprocExecutor spawns them, or Ray's actors host them).

One place for the three things both get wrong the same way when written twice: how a
child starts (the spawn context, OpenMP's settings and its C allocator in its
environment, a daemon parent
allowed daemon children), how its parent waits for its first message while watching
it die (so a child that crashes at start is reported at once with its exit code, not
when a timeout runs out), and what shutdown releases (sockets, pipes, a reader thread,
the processes, their socket folder), once, from a finalizer that holds no client.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import socket
import sys
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.context import SpawnProcess
from multiprocessing.popen_spawn_posix import Popen as SpawnPopen
from multiprocessing.process import BaseProcess
from typing import Any, Protocol

import zmq

from kvserve.utils.allocator import child_allocator_environment
from kvserve.utils.environ import environ_set
from kvserve.utils.threads import child_thread_environment

# A child's start-up error is raised again in its parent with its own type when it is
# one of these (what a bad config or a missing file raises); anything else as RuntimeError.
STARTUP_ERROR_TYPES: dict[str, type[Exception]] = {
    t.__name__: t
    for t in (ValueError, TypeError, NotImplementedError, FileNotFoundError, MemoryError, OSError)
}


def startup_error(error_type: str | None, message: str) -> Exception:
    """The exception a child reported at start-up, as its parent raises it."""
    return STARTUP_ERROR_TYPES.get(error_type or "", RuntimeError)(message)


# How many of its last stderr lines a child that fails at start is reported with.
STDERR_TAIL_LINES = 25
# What Python's spawn says in a child that re-ran an unguarded main script's kvserve call.
_UNGUARDED_MAIN = "bootstrapping phase"
UNGUARDED_MAIN_HINT = (
    "the main script starts kvserve when it is imported: every process kvserve spawns "
    "imports the main script again (multiprocessing's spawn start method), so the code "
    'that creates the LLM or engine must sit under `if __name__ == "__main__":`'
)


class StderrTail:
    """A child's stderr, passed through to ours as it comes, its last lines kept: a child
    that dies at start is reported with what it said (its traceback), not only its exit
    code."""

    def __init__(self, read_fd: int, lines: int = STDERR_TAIL_LINES) -> None:
        self._lines: deque[str] = deque(maxlen=lines)
        self._thread = threading.Thread(
            target=self._pump, args=(read_fd,), name="ChildStderr", daemon=True
        )
        self._thread.start()

    def _pump(self, read_fd: int) -> None:
        partial = b""
        with os.fdopen(read_fd, "rb", buffering=0) as pipe:
            while chunk := pipe.read(1 << 16):
                _write_all(2, chunk)
                *complete, partial = (partial + chunk).split(b"\n")
                partial = partial[-4096:]  # a progress bar redraws one line with \r
                self._lines.extend(line.decode(errors="replace") for line in complete)
        if partial:
            self._lines.append(partial.decode(errors="replace"))

    def text(self, wait_s: float = 1.0) -> str:
        """The last lines, once the child closed its stderr (it exited) or ``wait_s`` on."""
        self._thread.join(wait_s)
        return "\n".join(self._lines)


def _write_all(fd: int, data: bytes) -> None:
    try:
        while data:
            data = data[os.write(fd, data) :]
    except OSError:
        pass  # our own stderr is gone: the lines are still kept for the report


class ProcessHandle(Protocol):
    """What a parent needs of a child: a spawned process (BaseProcess), or an engine core
    on another node or in a Ray actor (engine/dp_remote.py), watched through the same
    sentinel fd."""

    @property
    def pid(self) -> int | None: ...
    @property
    def exitcode(self) -> int | None: ...
    @property
    def sentinel(self) -> int: ...
    def is_alive(self) -> bool: ...
    def join(self, timeout: float | None = None) -> None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


# Each child spawn() started, with the tail of its stderr (released with the process).
_stderr_tails: weakref.WeakKeyDictionary[BaseProcess, StderrTail] = weakref.WeakKeyDictionary()


def spawn(
    target: Callable[..., object],
    args: tuple[Any, ...],
    name: str,
    num_threads: int | None = None,
) -> BaseProcess:
    """Starts ``target(*args)`` in a fresh interpreter, as a daemon (it never outlives
    us). ``num_threads``: its OpenMP thread count (a worker's share of the cores);
    None, the machine's choice."""
    proc = _ReapedOnceProcess(target=target, args=args, name=name, daemon=True)
    read_fd, write_fd = os.pipe()
    try:
        with (
            child_thread_environment(),
            child_allocator_environment(),
            _omp_threads(num_threads),
            _children_allowed(),
            _stderr_to(write_fd),
        ):
            proc.start()
    finally:
        os.close(write_fd)
    _stderr_tails[proc] = StderrTail(read_fd)
    return proc


class _ReapedOncePopen(SpawnPopen):
    """Multiprocessing's spawned child, safe to wait on from several threads at once.

    Its ``poll`` is not: of two threads in ``waitpid`` together, one reaps the child and
    the other gets ECHILD, which ``poll`` answers as "still running". A client's output
    thread joins its core the moment the core's sentinel fires (MPClient._mark_dead)
    while its owner joins it or asks ``is_alive()``, so the owner could be told that a
    core which had exited was alive (and ``stop`` would signal its reaped pid). Here one
    thread at a time waits for the status and stores it, and the others read it."""

    def __init__(self, process_obj: BaseProcess) -> None:
        self._reap_lock = threading.Lock()
        super().__init__(process_obj)

    def poll(self, flag: int = os.WNOHANG) -> int | None:
        with self._reap_lock:
            return super().poll(flag)

    def wait(self, timeout: float | None = None) -> int | None:
        # On the sentinel, not in a blocking waitpid under the lock: a join() without a
        # timeout must not hold up another thread's is_alive() until the child exits.
        if self.returncode is None and not wait([self.sentinel], timeout):
            return None
        return self.poll(0)  # it has exited: its status is there, or a moment away


class _ReapedOnceProcess(SpawnProcess):
    @staticmethod
    def _Popen(process_obj: BaseProcess) -> SpawnPopen:
        return _ReapedOncePopen(process_obj)


@contextmanager
def _stderr_to(fd: int) -> Iterator[None]:
    """Our fd 2 is ``fd`` while a child is started, so that the child inherits it."""
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(fd, 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def pipe() -> tuple[Connection, Connection]:
    """(reader, writer): a one-way pipe a spawned child can inherit."""
    reader, writer = multiprocessing.get_context("spawn").Pipe(duplex=False)
    return reader, writer


def wait_for_handshake(
    reader: Connection, proc: ProcessHandle, timeout: float | None, who: str
) -> bytes:
    """The child's first message (closing ``reader``); raises TimeoutError if none came
    in ``timeout`` s while it lives, RuntimeError with its exit code and its last lines
    on stderr if it died (or closed its end of the pipe, dying) first."""
    try:
        ready = wait([reader, proc.sentinel], timeout)
        data = reader.recv_bytes() if reader.poll() else b""
    except EOFError:  # its end closed as it exits, maybe a moment before the sentinel
        data = b""
    finally:
        reader.close()
    if data:
        return data
    if not ready:
        raise TimeoutError(f"{who} did not start within {timeout} s")
    # It will never answer; give it a moment to exit so that its exit code and its last
    # words are known (a child can take seconds to exit after a failed start).
    proc.join(5)
    raise RuntimeError(startup_failure(proc, who))


def startup_failure(proc: ProcessHandle, who: str) -> str:
    """Why ``proc`` ended before its handshake: its exit code, its stderr's last lines,
    and the fix when it is the unguarded main script."""
    code = "still exiting" if proc.exitcode is None else f"exit code {proc.exitcode}"
    known = isinstance(proc, BaseProcess) and proc in _stderr_tails
    tail = _stderr_tails[proc].text() if known else ""  # type: ignore[index]
    message = f"{who} exited during startup ({code})"
    if _UNGUARDED_MAIN in tail:
        message += ": " + UNGUARDED_MAIN_HINT
    if tail:
        message += f"; its last lines on stderr:\n{tail}"
    return message


def stop(procs: list[ProcessHandle], grace_s: float = 3.0) -> None:
    """SIGTERM, then SIGKILL for whatever outlives ``grace_s``."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(grace_s)
        if proc.is_alive():
            proc.kill()
            proc.join(1)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ChildResources:
    """What a parent releases at shutdown: a weakref.finalize target, so it holds no
    client or executor (they can be collected while it waits)."""

    ctx: zmq.Context[Any]
    sockets: list[zmq.Socket[Any]] = field(default_factory=list)
    procs: list[ProcessHandle] = field(default_factory=list)
    tmpdir: str | None = None
    fds: list[int] = field(default_factory=list)
    # A thread reading the sockets, woken through ``wake_fd`` before they close.
    thread: threading.Thread | None = None
    wake_fd: int | None = None
    # Children told to exit (a shutdown message) get this long before SIGTERM...
    exit_grace_s: float = 0.0
    # ... and this long after it, before SIGKILL.
    stop_grace_s: float = 3.0
    closed: bool = False

    def __call__(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.thread is not None and self.wake_fd is not None:
            os.write(self.wake_fd, b"x")
            if self.thread is not threading.current_thread():
                self.thread.join(5)
        if self.exit_grace_s:
            for proc in self.procs:
                proc.join(self.exit_grace_s)
        stop(self.procs, self.stop_grace_s)
        for sock in self.sockets:
            sock.close(linger=0)
        self.ctx.term()
        for fd in self.fds:
            os.close(fd)
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)


@contextmanager
def _omp_threads(num_threads: int | None) -> Iterator[None]:
    if num_threads is None:
        yield
        return
    with environ_set({"OMP_NUM_THREADS": str(num_threads)}):
        yield


@contextmanager
def _children_allowed() -> Iterator[None]:
    """The engine core runs as a daemon process (so it never outlives its client), and
    multiprocessing refuses daemons children. Ours are daemons too, watched by their
    parent and stopped at its shutdown, so the rule's concern (orphans) is met here."""
    config = multiprocessing.current_process()._config  # type: ignore[attr-defined]
    was_daemon = config.get("daemon", False)
    config["daemon"] = False
    try:
        yield
    finally:
        config["daemon"] = was_daemon
