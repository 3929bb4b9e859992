"""The engine-core process started before its config exists (core_launcher.py); the
core that gets its config and serves is tested through the client in test_core_proc.py."""

from __future__ import annotations

import pytest

from kvserve.engine import core_launcher
from kvserve.engine.core_launcher import (
    CoreStartup,
    claim_engine_core,
    discard_prestarted_core,
    prestart_engine_core,
)


def test_a_core_whose_parent_sends_no_config_exits_cleanly() -> None:
    # e.g. `kvserve serve` with flags it rejects after the core was spawned.
    startup = CoreStartup.spawn()
    startup.config_writer.close()
    startup.proc.join(120)
    assert startup.proc.exitcode == 0
    with pytest.raises(EOFError):  # no handshake: it never built an engine
        startup.ready_reader.recv_bytes()
    startup.ready_reader.close()


def test_an_unclaimed_prestarted_core_is_stopped_and_a_claim_spawns_its_own() -> None:
    prestart_engine_core()
    prestarted = core_launcher._prestarted
    assert prestarted is not None and prestarted.proc.is_alive()
    prestart_engine_core()  # at most one waits
    assert core_launcher._prestarted is prestarted
    discard_prestarted_core()
    assert core_launcher._prestarted is None
    assert not prestarted.proc.is_alive()
    fresh = claim_engine_core()
    try:
        assert fresh.proc.pid != prestarted.proc.pid and fresh.proc.is_alive()
    finally:
        fresh.discard()
    assert not fresh.proc.is_alive()
