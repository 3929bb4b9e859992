"""Errors the engine front end raises when the engine core cannot answer."""

from __future__ import annotations


class EngineDeadError(Exception):
    """The engine-core process is gone: every pending and future call fails with this.

    Nothing can be recovered in this process; the server should report unhealthy and exit.
    """

    def __init__(self, message: str | None = None) -> None:
        super().__init__(
            message or "EngineCore process died unexpectedly; see its log above for the cause"
        )
