"""Start-up phases: logged in one shape, read back by `kvserve bench startup`."""

from __future__ import annotations

import logging

import pytest

from kvserve.utils.startup import parse_phases, startup_phase


def test_phases_are_logged_and_parsed(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvserve.startup"):
        with startup_phase("model load", executor="X"):
            pass
        with pytest.raises(RuntimeError), startup_phase("tokenizer (cached)"):
            raise RuntimeError("a failed phase is logged too")
        with startup_phase("model load"):
            pass
    phases = parse_phases(caplog.text)
    assert set(phases) == {"model load", "tokenizer (cached)"}
    assert all(seconds >= 0 for seconds in phases.values())
    assert "executor=X" in caplog.text
