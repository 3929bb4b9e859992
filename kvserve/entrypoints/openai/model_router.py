"""ModelRouter: the models one server answers for, each loaded on first use into its own
engine (an AsyncLLM whose engine core is its own process), the least recently used one
unloaded past ``--max-loaded-models``.

One writer: every state change happens on the event loop, in this module. A request holds
a ModelLease while it runs (a stream until its last chunk), so a model is unloaded only
once its requests have finished; a request that arrives while its model drains waits for
the unload and then loads it again. Loads run one at a time (the engine starts in a
thread, the loop keeps serving the loaded models meanwhile). A dead engine core fails its
own requests (503) and leaves its model unloaded, to be loaded again by the next request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Literal

from kvserve.engine.engine_client import EngineClient
from kvserve.entrypoints.openai.model_sources import ModelSource
from kvserve.entrypoints.openai.protocol import ModelCard, ModelList, OpenAIServingError
from kvserve.entrypoints.openai.serving_models import OpenAIServingModels
from kvserve.entrypoints.openai.serving_stack import ServingStack
from kvserve.metrics.loggers import StatLoggerBase

logger = logging.getLogger(__name__)

# "sleeping": loaded, its engine asleep (POST /sleep); its requests get 503 until woken.
ModelStatus = Literal["loaded", "loading", "unloaded", "sleeping"]
# Starts a model's engine (blocking; run in a thread): its source, and whether it is the
# server's first model (which alone reports to /metrics: one registry, one engine).
EngineStarter = Callable[[ModelSource, bool], EngineClient]
# The serving objects over a freshly started engine; the OpenAIServingModels of the
# model's first load is passed back on every later one.
StackBuilder = Callable[[EngineClient, OpenAIServingModels | None], ServingStack]


class ServedModel:
    """One model's state: its serving stack while loaded, its requests in flight and when
    it was last used (the LRU order)."""

    def __init__(self, source: ModelSource) -> None:
        self.source = source
        self.name = source.name
        self.stack: ServingStack | None = None
        self.loading = False
        self.draining = False
        self.in_flight = 0
        # Requests waiting for this model's load: admitted by the load itself, so that
        # nothing can unload the model between its load and their first step.
        self.waiting = 0
        self.last_used = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.unloaded = asyncio.Event()
        self.unloaded.set()
        self.stat_loggers: list[StatLoggerBase] = []

    @property
    def status(self) -> ModelStatus:
        if self.loading:
            return "loading"
        if self.stack is None:
            return "unloaded"
        return "sleeping" if self.stack.engine_client.sleeping else "loaded"

    def add_stat_logger(self, stat_logger: StatLoggerBase) -> None:
        """Records this model's engine stats, across its unloads and reloads."""
        self.stat_loggers.append(stat_logger)
        if self.stack is not None:
            self.stack.engine_client.add_stat_logger(stat_logger)

    def admit(self, count: int, stamp: int) -> None:
        self.in_flight += count
        self.last_used = stamp
        if self.in_flight:
            self.idle.clear()

    def release(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self.idle.set()

    def install(self, stack: ServingStack) -> None:
        for stat_logger in self.stat_loggers:
            stack.engine_client.add_stat_logger(stat_logger)
        self.stack = stack
        self.unloaded.clear()

    def uninstall(self) -> None:
        """Shuts the engine down: its core process exits and its memory goes back."""
        assert self.stack is not None
        stack, self.stack = self.stack, None
        stack.engine_client.shutdown()
        self.unloaded.set()


class ModelLease:
    """A request's hold on its model: the model stays loaded until release()."""

    def __init__(self, served: ServedModel) -> None:
        assert served.stack is not None
        self.stack: ServingStack = served.stack
        self._served: ServedModel | None = served

    def release(self) -> None:
        if self._served is not None:
            self._served.release()
            self._served = None

    def hold(self, stream: AsyncIterator[str]) -> AsyncIterator[str]:
        """``stream``, releasing this lease once it ends or is closed."""
        return _LeasedStream(stream, self)


class _LeasedStream:
    """An SSE stream that releases its lease when exhausted or closed (the response
    always closes its body iterator, even when it never started it)."""

    def __init__(self, stream: AsyncIterator[str], lease: ModelLease) -> None:
        self._stream = stream
        self._lease = lease

    def __aiter__(self) -> _LeasedStream:
        return self

    async def __anext__(self) -> str:
        try:
            return await anext(self._stream)
        except BaseException:
            self._lease.release()
            raise

    async def aclose(self) -> None:
        try:
            aclose = getattr(self._stream, "aclose", None)
            if aclose is not None:
                await aclose()
        finally:
            self._lease.release()


class ModelRouter:
    """Routes a request's ``model`` to its ServedModel, loading and unloading engines."""

    def __init__(
        self,
        sources: list[ModelSource],
        start_engine: EngineStarter,
        build_stack: StackBuilder,
        max_loaded_models: int | None = None,
    ) -> None:
        self.models = {source.name: ServedModel(source) for source in sources}
        self.default = self.models[sources[0].name]
        self.max_loaded = max_loaded_models or len(sources)
        self._start_engine = start_engine
        self._build_stack = build_stack
        self._model_records: dict[str, OpenAIServingModels] = {}
        self._clock = itertools.count(1)
        self._load_lock = asyncio.Lock()
        self._loads: dict[str, asyncio.Task[None]] = {}

    @property
    def single(self) -> bool:
        """One model: the server lives and dies with its engine, as it always has."""
        return len(self.models) == 1

    def adopt(self, engine_client: EngineClient) -> ServingStack:
        """Installs the default model's engine, started before the server."""
        self._install(self.default, engine_client)
        assert self.default.stack is not None
        return self.default.stack

    def resolve(self, requested: str | None) -> ServedModel:
        """The model a request names (none: the default); a 404 for another name."""
        if not requested:
            return self.default
        served = self.models.get(requested)
        if served is not None:
            return served
        for name, record in self._model_records.items():
            if requested in record.lora_requests:
                return self.models[name]
        raise OpenAIServingError(
            f"The model `{requested}` does not exist.", status=404, param="model"
        )

    async def acquire(self, requested: str | None) -> ModelLease:
        """A lease on the model ``requested`` names, once it is loaded (loading it, and
        unloading the least recently used, if need be). Cancellation-safe."""
        served = self.resolve(requested)
        while served.stack is None or served.draining:
            if served.draining:
                await served.unloaded.wait()
                continue
            load = self._load_task(served)
            served.waiting += 1
            try:
                await asyncio.shield(load)
            except BaseException:
                if load.done() and not load.cancelled() and load.exception() is None:
                    served.release()  # the load admitted this request before it left
                else:
                    served.waiting -= 1
                raise
            return ModelLease(served)
        served.admit(1, next(self._clock))
        return ModelLease(served)

    def loaded_stacks(self) -> list[ServingStack]:
        return [m.stack for m in self.models.values() if m.stack is not None]

    def show_models(self) -> ModelList:
        """Every model with its status, loaded or not (then from its first load, if any)."""
        cards: list[ModelCard] = []
        for name, served in self.models.items():
            record = self._model_records.get(name)
            own = (
                [ModelCard(id=name, root=served.source.engine_args.model)]
                if record is None
                else record.show_available_models().data
            )
            for card in own:  # the model and its LoRA adapters
                card.status = served.status
            cards += own
        return ModelList(data=cards)

    async def check_health(self) -> None:
        """Raises the error of a loaded engine that died (until its model is unloaded)."""
        for stack in self.loaded_stacks():
            await stack.engine_client.check_health()

    def unload_dead_engines(self) -> list[str]:
        """Marks the models whose engine core died unloaded; their names."""
        dead = [
            served
            for served in self.models.values()
            if served.stack is not None
            and not served.draining
            and served.stack.engine_client.errored
        ]
        for served in dead:
            logger.error("the engine core of model %s died; it is unloaded", served.name)
            served.uninstall()
        return [served.name for served in dead]

    def shutdown(self) -> None:
        for task in self._loads.values():
            task.cancel()
        for served in self.models.values():
            if served.stack is not None:
                served.uninstall()

    # --- loading -------------------------------------------------------------------------

    def _load_task(self, served: ServedModel) -> asyncio.Task[None]:
        task = self._loads.get(served.name)
        if task is None or task.done():
            task = asyncio.create_task(self._load(served), name=f"load {served.name}")
            self._loads[served.name] = task
        return task

    async def _load(self, served: ServedModel) -> None:
        async with self._load_lock:
            if served.stack is None:
                while sum(m.stack is not None for m in self.models.values()) >= self.max_loaded:
                    await self._unload(self._victim(served))
                served.loading = True
                try:
                    first = served is self.default
                    engine_client = await asyncio.to_thread(
                        self._start_engine, served.source, first
                    )
                except Exception as exc:
                    logger.error("model %s failed to load", served.name, exc_info=exc)
                    raise OpenAIServingError(
                        f"The model `{served.name}` could not be loaded (see the server log).",
                        status=503,
                    ) from None
                finally:
                    served.loading = False
                self._install(served, engine_client)
                logger.info("model %s loaded", served.name)
            served.admit(served.waiting, next(self._clock))
            served.waiting = 0

    def _victim(self, loading: ServedModel) -> ServedModel:
        # Idle models first, then the least recently used.
        loaded = [m for m in self.models.values() if m.stack is not None and m is not loading]
        return min(loaded, key=lambda m: (m.in_flight > 0, m.last_used))

    async def _unload(self, served: ServedModel) -> None:
        served.draining = True
        try:
            await served.idle.wait()
            if served.stack is not None:  # a dead engine may have been unloaded meanwhile
                served.uninstall()
        finally:
            served.draining = False
        logger.info("model %s unloaded", served.name)

    def _install(self, served: ServedModel, engine_client: EngineClient) -> None:
        stack = self._build_stack(engine_client, self._model_records.get(served.name))
        self._model_records.setdefault(served.name, stack.models)
        served.install(stack)
