"""Errors the engine front end raises when the engine core cannot answer (or, asleep
or busy, may not)."""

from __future__ import annotations


class EngineDeadError(Exception):
    """The engine-core process is gone: every pending and future call fails with this.

    Nothing can be recovered in this process; the server should report unhealthy and exit.
    """

    def __init__(self, message: str | None = None, engine_index: int | None = None) -> None:
        super().__init__(
            message or "EngineCore process died unexpectedly; see its log above for the cause"
        )
        # With data parallelism: the rank of the core that died (None: not one core's).
        self.engine_index = engine_index


class EngineSleepingError(RuntimeError):
    """The engine sleeps (sleep mode): it takes no request until it is woken up."""

    def __init__(self) -> None:
        super().__init__("the model is sleeping: POST /wake_up (LLM.wake_up) before generating")


class EngineBusyError(Exception):
    """Sleep was asked of an engine with requests in flight, whose KV it would free."""
