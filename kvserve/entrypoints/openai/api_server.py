"""The OpenAI-compatible HTTP server: FastAPI routes over an AsyncLLM, run by uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

import kvserve
from kvserve.engine.engine_client import EngineClient
from kvserve.entrypoints.openai.admission import (
    error_response,
)
from kvserve.entrypoints.openai.anthropic_errors import (
    AnthropicErrorMiddleware,
    error_event,
)
from kvserve.entrypoints.openai.audio_routes import register_audio_routes
from kvserve.entrypoints.openai.embedding_protocol import EmbeddingRequest
from kvserve.entrypoints.openai.http_middleware import RequestIdMiddleware, add_hardening_middleware
from kvserve.entrypoints.openai.lora_protocol import (
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)
from kvserve.entrypoints.openai.model_router import ModelLease, ModelRouter
from kvserve.entrypoints.openai.model_sources import ModelSource, model_sources
from kvserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIServingError,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from kvserve.entrypoints.openai.protocol_anthropic import (
    AnthropicCountTokensRequest,
    AnthropicMessagesRequest,
)
from kvserve.entrypoints.openai.protocol_responses import ResponsesRequest
from kvserve.entrypoints.openai.serving_engine import INTERNAL_ERROR_MESSAGE
from kvserve.entrypoints.openai.serving_stack import (
    ServingStack,
    build_serving_stack,
    serving_models,
)
from kvserve.entrypoints.openai.sleep_routes import register_sleep_routes
from kvserve.entrypoints.openai.streaming import (
    GuardedStreamingResponse,
    openai_error_event,
    stream_with_deadline,
    timeout_error,
)
from kvserve.entrypoints.web import register_web_ui
from kvserve.utils import memory_trace
from kvserve.utils.heap_trim import HeapTrimmer

logger = logging.getLogger(__name__)
T = TypeVar("T")
# How often the server checks whether the engine core died while nobody was asking.
ENGINE_WATCH_INTERVAL_S = 0.5


_error = error_response


async def _until_disconnect(
    raw_request: Request, work: Awaitable[T], timeout_s: float | None = None
) -> T | Response:
    """Runs ``work`` unless the client hangs up first or ``timeout_s`` passes; then cancels
    it, which aborts the engine request (generate() aborts on cancellation) and frees its
    KV blocks. A timeout is a 408; a stream's timeout is kept by the stream itself."""

    async def disconnected() -> None:
        while (await raw_request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        if not watcher.cancelled() and watcher.done():
            logger.info("client disconnected; request aborted")
            return Response(status_code=499)
        assert timeout_s is not None
        logger.info("request aborted by the request timeout (%g s)", timeout_s)
        return _error(timeout_error(timeout_s))
    return task.result()


def _respond(
    result: Any,
    args: argparse.Namespace | None = None,
    lease: ModelLease | None = None,
    stream_error: Callable[[OpenAIServingError], str] = openai_error_event,
) -> Response:
    """The HTTP response for a handler's result; a stream releases ``lease`` when closed,
    and ends with ``stream_error`` (in its API's shape) if it runs out of time."""
    if isinstance(result, Response):
        return result
    if isinstance(result, AsyncIterator):
        timeout_s = getattr(args, "request_timeout", None)
        content = stream_with_deadline(result, timeout_s, stream_error)
        return GuardedStreamingResponse(
            content if lease is None else lease.hold(content),
            stall_timeout_s=getattr(args, "stream_stall_timeout", None),
        )
    return JSONResponse(result.model_dump())


def build_app(router: ModelRouter, args: argparse.Namespace) -> FastAPI:
    """The FastAPI app over ``router``'s models (its default one loaded); ``args`` from
    add_serve_args. Admission control and the web UI follow the default model."""
    default_stack = router.loaded_stacks()[0]
    engine_client = default_stack.engine_client

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        watch = asyncio.create_task(_watch_engines(app))
        trim = asyncio.create_task(_trim_heap(HeapTrimmer()))
        yield
        watch.cancel()
        trim.cancel()

    docs = not getattr(args, "disable_fastapi_docs", False)
    app = FastAPI(
        title="kvserve OpenAI-compatible server",
        version=kvserve.__version__,
        lifespan=lifespan,
        openapi_url="/openapi.json" if docs else None,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
    )
    app.state.engine_client = engine_client
    app.state.router = router
    app.state.server = None  # set by run_server, so a dead engine can stop uvicorn
    request_timeout: float | None = getattr(args, "request_timeout", None)

    async def serve(
        raw_request: Request,
        model: str | None,
        work: Callable[[ServingStack], Awaitable[Any]],
        stream_error: Callable[[OpenAIServingError], str] = openai_error_event,
    ) -> Response:
        """Runs ``work`` on the stack of the model a request names (loaded first if need
        be, within the request's timeout and disconnect rules) and responds."""

        stream_lease: list[ModelLease] = []

        async def leased() -> Any:
            lease = await router.acquire(model)
            try:
                result = await work(lease.stack)
            except BaseException:
                lease.release()
                raise
            if isinstance(result, AsyncIterator):
                stream_lease.append(lease)  # the model stays loaded until the stream ends
            else:
                lease.release()
            return result

        result = await _until_disconnect(raw_request, leased(), request_timeout)
        return _respond(result, args, stream_lease[0] if stream_lease else None, stream_error)

    @app.exception_handler(OpenAIServingError)
    async def serving_error(_: Request, exc: OpenAIServingError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        # OpenAI answers malformed bodies with 400, not FastAPI's 422.
        errors = exc.errors()
        if errors and errors[0].get("type") == "json_invalid":
            detail = errors[0].get("ctx", {}).get("error", "")
            return _error(OpenAIServingError(f"Malformed JSON body: {detail}".rstrip(": ")))
        locs = [_field_path(e.get("loc", ())) for e in errors]
        # A body that is a union of models fails in each member alike: say it once.
        message = "; ".join(
            dict.fromkeys(
                f"{loc or 'body'}: {e['msg']}" for loc, e in zip(locs, errors, strict=True)
            )
        )
        # The param is the top-level field, as OpenAI names it ("prompt", not "prompt.str").
        param = locs[0].split(".")[0] if locs and locs[0] else None
        return _error(OpenAIServingError(message or "invalid request", param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(OpenAIServingError(str(exc.detail), status=exc.status_code))

    @app.exception_handler(Exception)
    async def unexpected_error(_: Request, exc: Exception) -> JSONResponse:
        # The traceback goes to the log; the client learns only that it was not its fault.
        logger.exception("unhandled error in a request")
        return _error(OpenAIServingError(INTERNAL_ERROR_MESSAGE, status=500))

    @app.get("/health")
    async def health() -> Response:
        try:
            await router.check_health()
        except Exception as exc:
            return _error(OpenAIServingError(f"engine is not healthy: {exc}", status=503))
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": kvserve.__version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def show_models() -> JSONResponse:
        return JSONResponse(router.show_models().model_dump())

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await serve(
            raw_request,
            request.model,
            lambda stack: stack.completion.create_completion(request, raw_request),
        )

    @app.post("/v1/chat/completions")
    async def create_chat_completion(
        request: ChatCompletionRequest, raw_request: Request
    ) -> Response:
        return await serve(
            raw_request,
            request.model,
            lambda stack: stack.chat.create_chat_completion(request, raw_request),
        )

    @app.post("/v1/responses")
    async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
        return await serve(
            raw_request,
            request.model,
            lambda stack: stack.responses.create_response(request, raw_request),
        )

    @app.post("/v1/messages")
    async def create_message(request: AnthropicMessagesRequest, raw_request: Request) -> Response:
        return await serve(
            raw_request,
            request.model,
            lambda stack: stack.messages.create_message(request, raw_request),
            stream_error=error_event,
        )

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(
        request: AnthropicCountTokensRequest, raw_request: Request
    ) -> Response:
        return await serve(
            raw_request, request.model, lambda stack: stack.messages.count_tokens(request)
        )

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> Response:
        # Stored with the model that answered; the default model's 404 otherwise.
        stacks = router.loaded_stacks()
        holder = next((s for s in stacks if response_id in s.responses.store), stacks[0])
        return _respond(holder.responses.retrieve(response_id))

    @app.post("/v1/embeddings")
    async def create_embedding(request: EmbeddingRequest, raw_request: Request) -> Response:
        return await serve(
            raw_request,
            request.model,
            lambda stack: stack.embedding.create_embedding(request, raw_request),
        )

    register_audio_routes(app, serve)

    # Adapters are the default model's (their base model must match its weights).
    models = default_stack.models

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> Response:
        models.load_lora_adapter(request.lora_name, request.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> Response:
        models.unload_lora_adapter(request.lora_name)
        return PlainTextResponse(
            f"Success: LoRA adapter '{request.lora_name}' removed successfully."
        )

    @app.post("/tokenize")
    async def tokenize(
        request: TokenizeChatRequest | TokenizeCompletionRequest, raw_request: Request
    ) -> Response:
        return await serve(
            raw_request,
            request.model,
            lambda stack: stack.tokenization.create_tokenize(request),
        )

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest, raw_request: Request) -> Response:
        return await serve(
            raw_request,
            request.model,
            lambda stack: stack.tokenization.create_detokenize(request),
        )

    if getattr(args, "enable_request_census", False):

        @app.get("/debug/census")
        async def request_census() -> JSONResponse:
            lease = await router.acquire(None)
            try:
                return JSONResponse(await lease.stack.engine_client.request_census())
            finally:
                lease.release()

    if engine_client.config.model_config.enable_sleep_mode:

        @contextlib.asynccontextmanager
        async def engine_for(model: str | None) -> AsyncIterator[EngineClient]:
            # Held for the call: the model cannot be unloaded while it sleeps or wakes.
            lease = await router.acquire(model)
            try:
                yield lease.stack.engine_client
            finally:
                lease.release()

        register_sleep_routes(app, engine_for)

    register_web_ui(app, router.default, args)
    add_hardening_middleware(app, engine_client, args)
    # Outside the hardening middlewares: their refusals get Anthropic's shape there too.
    app.add_middleware(AnthropicErrorMiddleware)
    if getattr(args, "allowed_origins", None):
        app.add_middleware(
            CORSMiddleware,
            allow_origins=args.allowed_origins,
            allow_credentials=True,
            allow_methods=["*"],
            allow_headers=["*"],
        )
    app.add_middleware(RequestIdMiddleware)
    return app


def _field_path(loc: Any) -> str:
    """ "messages.0.content" of a validation error's location: without "body", and without
    the model's name pydantic puts first when the body is a union of models (/tokenize)."""
    parts = [str(p) for p in loc if p != "body"]
    if parts and parts[0][:1].isupper():
        parts = parts[1:]
    return ".".join(parts)


async def _trim_heap(heap: HeapTrimmer) -> None:
    """The server's own allocations (requests, responses, detokenized text) fragment
    its heap too (utils/heap_trim.py); a trim takes milliseconds, between requests."""
    if not heap.enabled:
        return
    while True:
        await asyncio.sleep(heap.interval_s)
        heap.trim()


async def _watch_engines(app: FastAPI) -> None:
    """With one model, stops the server once its engine core is dead: nothing can be
    served any more. With several, a dead engine's model is unloaded (its requests got
    503s; the next one loads it again) and the others keep serving."""
    router: ModelRouter = app.state.router
    while not (router.single and app.state.engine_client.errored):
        await asyncio.sleep(ENGINE_WATCH_INTERVAL_S)
        if not router.single:
            router.unload_dead_engines()
    logger.error(
        "the engine core died (%s); shutting the server down",
        app.state.engine_client.dead_error,
    )
    if app.state.server is not None:
        app.state.server.should_exit = True


async def serve_http(
    args: argparse.Namespace,
    engine: EngineClient | None = None,
    sources: list[ModelSource] | None = None,
) -> int:
    """Serves ``sources`` (model_sources(args) if not given), the first on ``engine``
    (started here if not given), until SIGTERM/SIGINT (or, with one model, engine death),
    then shuts every engine down; the exit code."""
    memory_trace.start_from_env("api_server")
    sources = sources if sources is not None else model_sources(args)
    if engine is None:
        engine = start_engine(sources[0], True)
    router = ModelRouter(
        sources,
        start_engine,
        lambda client, models: build_serving_stack(
            client, models or serving_models(client, args), args
        ),
        getattr(args, "max_loaded_models", None),
    )
    try:
        router.adopt(engine)
        app = build_app(router, args)
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            # SIGTERM: stop accepting, let in-flight requests finish for this long.
            timeout_graceful_shutdown=args.shutdown_timeout,
            access_log=False,
            root_path=getattr(args, "root_path", None) or "",
            ssl_keyfile=getattr(args, "ssl_keyfile", None),
            ssl_certfile=getattr(args, "ssl_certfile", None),
        )
        server = uvicorn.Server(config)
        app.state.server = server
        # uvicorn re-raises the SIGTERM/SIGINT it caught once it has drained; these
        # handlers turn that into a normal return so the engine is shut down cleanly below.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)
        await server.serve()
        # Checked before shutdown(), after which the core is gone on purpose.
        engine_died = router.single and engine.errored
    finally:
        router.shutdown()
        engine.shutdown()  # the first engine, whether or not the router adopted it
    return 1 if engine_died else 0


def start_engine(source: ModelSource, first: bool) -> EngineClient:
    """A model's AsyncLLM (its engine core process started, the model loaded). Only the
    first model reports to /metrics: the metrics have one registry and one engine."""
    from kvserve.engine.async_llm import AsyncLLM
    from kvserve.metrics.loggers import LoggingStatLogger

    if first or source.engine_args.disable_log_stats:
        return AsyncLLM.from_engine_args(source.engine_args)
    return AsyncLLM.from_engine_args(source.engine_args, stat_loggers=[LoggingStatLogger()])


def run_server(args: argparse.Namespace) -> int:
    return asyncio.run(serve_http(args))


if __name__ == "__main__":
    # `python -m kvserve.entrypoints.openai.api_server [MODEL] [flags]`, as in vLLM: the
    # `kvserve serve` command itself, so its thread settings and its engine core spawned
    # before the flags are parsed hold here too.
    import sys

    from kvserve.entrypoints.cli import main

    sys.exit(main(["serve", *sys.argv[1:]]))
