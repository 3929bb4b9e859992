"""Spawning the engine-core process, before its config exists if need be.

Most of a server's start-up is the core's imports (torch and the model stack: two
seconds on a small CPU), and they need nothing from the config. So the core is spawned
with two pipes: it imports first, then reads its config from one pipe and answers with
its handshake on the other (EngineCoreProc.run_engine_core). ``kvserve serve`` spawns it
first thing (prestart_engine_core) and parses its flags, builds the engine config and the
tokenizer while the core imports; MPClient then takes that process (claim_engine_core)
instead of spawning its own.

The config reaches the child pickled, as multiprocessing's spawn would carry it: the
child is our own process. Everything after the handshake travels as msgpack over ZMQ.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Literal, Protocol

from kvserve.utils.processes import ProcessHandle, pipe, spawn, stop

if TYPE_CHECKING:
    from kvserve.config import EngineConfig

logger = logging.getLogger(__name__)


class CoreStartupHandle(Protocol):
    """An engine core on its way up, as its client takes it: a process spawned here
    (CoreStartup), or a core on another node or in a Ray actor (dp_remote.py)."""

    @property
    def transport(self) -> Literal["ipc", "tcp"]:
        """How the client's two sockets are reached: "ipc" on this machine, else "tcp"."""

    @property
    def proc(self) -> ProcessHandle: ...
    @property
    def ready_reader(self) -> Connection: ...
    @property
    def started(self) -> float: ...

    def send_config(
        self, config: EngineConfig, input_address: str, output_address: str, log_level: int
    ) -> None: ...


@dataclass
class CoreStartup:
    """A spawned engine core that waits for its config (then loads the model)."""

    proc: ProcessHandle
    config_writer: Connection
    ready_reader: Connection
    started: float  # time.perf_counter() at the spawn
    transport: Literal["ipc", "tcp"] = field(default="ipc", init=False)

    @classmethod
    def spawn(cls) -> CoreStartup:
        config_reader, config_writer = pipe()
        ready_reader, ready_writer = pipe()
        started = time.perf_counter()
        proc = spawn(_core_main, (config_reader, ready_writer, time.time()), "EngineCore")
        config_reader.close()
        ready_writer.close()
        return cls(proc, config_writer, ready_reader, started)

    def send_config(
        self, config: EngineConfig, input_address: str, output_address: str, log_level: int
    ) -> None:
        """Hands the core what it builds itself from, without waiting for it to read:
        a child still importing would block a send larger than the pipe's buffer, and
        the caller has its own start-up to do meanwhile."""
        payload = (config, input_address, output_address, log_level)
        threading.Thread(
            target=self._send, args=(payload,), name="EngineCoreConfig", daemon=True
        ).start()

    def _send(self, payload: object) -> None:
        try:
            self.config_writer.send(payload)
        except OSError:
            pass  # it died: the handshake wait reports its exit code
        finally:
            self.config_writer.close()

    def discard(self) -> None:
        """Stops a core that will never get a config (e.g. the flags were invalid)."""
        self.config_writer.close()
        self.ready_reader.close()
        stop([self.proc], grace_s=5.0)


def _core_main(config_reader: Connection, ready_writer: Connection, spawned_at: float) -> None:
    """The spawned process: imports, then its config, then EngineCoreProc's life.

    A module of its own (this light one) is the target, so that unpickling it in the
    child imports nothing before the timed imports start."""
    interpreter_s = time.time() - spawned_at
    imports_start = time.perf_counter()
    # The core's process only: torch and the model stack (.importlinter names this edge).
    from kvserve.engine_core.core_proc import EngineCoreProc

    imports_s = time.perf_counter() - imports_start
    try:
        config, input_address, output_address, log_level = config_reader.recv()
    except EOFError:  # prestarted, then never claimed: nothing to serve
        raise SystemExit(0) from None
    finally:
        config_reader.close()
    EngineCoreProc.run_engine_core(
        config,
        input_address,
        output_address,
        ready_writer,
        log_level,
        {"engine core interpreter": interpreter_s, "engine core imports": imports_s},
    )


_prestarted: CoreStartup | None = None


def prestart_engine_core() -> None:
    """Spawns the core now, for the next claim_engine_core in this process."""
    global _prestarted
    if _prestarted is None:
        _prestarted = CoreStartup.spawn()


def claim_engine_core() -> CoreStartup:
    """The prestarted core if there is one (once), else a core spawned now."""
    global _prestarted
    startup, _prestarted = _prestarted, None
    if startup is not None and startup.proc.is_alive():
        logger.debug("using the engine core process %d started in advance", startup.proc.pid)
        return startup
    if startup is not None:
        startup.discard()
    return CoreStartup.spawn()


def discard_prestarted_core() -> None:
    """Stops a prestarted core nothing claimed (a no-op once one was claimed)."""
    global _prestarted
    startup, _prestarted = _prestarted, None
    if startup is not None:
        startup.discard()
