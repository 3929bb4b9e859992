"""Process plumbing of MultiprocExecutor: what its shutdown releases, how worker
processes are started (their thread share, from a daemon parent) and stopped."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any

import zmq

from kvserve.utils.threads import child_thread_environment


@dataclass
class WorkerResources:
    """What shutdown releases; a weakref.finalize target, so it holds no executor."""

    ctx: zmq.Context[Any]
    sockets: list[zmq.Socket[Any]] = field(default_factory=list)
    procs: list[BaseProcess] = field(default_factory=list)
    tmpdir: str = ""
    wake_w: int = -1
    wake_r: int = -1
    failed_r: int = -1  # readable once a worker is lost (MultiprocExecutor.failure_fd)
    failed_w: int = -1
    thread: threading.Thread | None = None
    closed: bool = False

    def __call__(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.thread is not None:
            os.write(self.wake_w, b"x")
            self.thread.join(5)
        for proc in self.procs:
            proc.join(2)
        kill(self.procs)
        for sock in self.sockets:
            sock.close(linger=0)
        self.ctx.term()
        for fd in (self.wake_r, self.wake_w, self.failed_r, self.failed_w):
            os.close(fd)
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def kill(procs: list[BaseProcess]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(3)
        if proc.is_alive():
            proc.kill()
            proc.join(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def worker_threads(num_threads: int) -> Iterator[None]:
    """Spawned workers load OpenMP with this rank's share of the cores."""
    with child_thread_environment():
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = str(num_threads)
        try:
            yield
        finally:
            if saved is not None:
                os.environ["OMP_NUM_THREADS"] = saved


@contextmanager
def children_allowed() -> Iterator[None]:
    """The engine core runs as a daemon process (so it never outlives its client), and
    multiprocessing refuses daemons children. Ours are daemons too, watched by their
    parent and killed at shutdown, so the rule's concern (orphans) is handled here."""
    config = multiprocessing.current_process()._config  # type: ignore[attr-defined]
    was_daemon = config.get("daemon", False)
    config["daemon"] = False
    try:
        yield
    finally:
        config["daemon"] = was_daemon
