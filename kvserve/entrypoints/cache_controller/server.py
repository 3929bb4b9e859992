"""`kvserve cache-controller`: one HTTP + JSON service over the KV tiers of many instances.

Instances register (POST /register) with their control endpoint and event streams; the
controller follows the streams into a TierIndex and answers:

- POST /lookup   {tokens | text} -> {instance: {tier: cached prefix tokens}}
- POST /pin, /unpin {instance, tier, tokens | text}: pinned chunks are never evicted
  from that tier (a put that would need them is dropped instead)
- POST /clear    {instance, tier}
- POST /move     {source, source_tier, target, target_tier, tokens | text}: the source's
  chunks of the prefix are copied into the target's tier (sealed with the KV secret's MAC)
- POST /deregister {url}, GET /health, GET /instances, and the OpenAPI schema at
  /openapi.json.

Pin, clear and move reach the instance's CacheEngine through its control service
(kvserve/kvcache/control.py); text is tokenized by the instance's /tokenize. Errors have
OpenAI's body shape: 400 for a bad body (naming the field), 404 for an unknown instance,
502 when an instance does not answer. LMCache's cache controller (lmcache/v1/
cache_controller) has the same operations; this one is a single process with the index
in memory: a restarted controller needs the instances to register again.
"""

from __future__ import annotations

import argparse
import logging
import secrets
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from kvserve.entrypoints.cache_controller.index import DEVICE, HashLayout, TierIndex
from kvserve.entrypoints.cache_controller.instances import Instance, StreamFollowers
from kvserve.entrypoints.cache_controller.protocol import (
    ClearRequest,
    DeregisterRequest,
    HealthResponse,
    InstanceInfo,
    LookupResponse,
    MoveRequest,
    MoveResponse,
    PinRequest,
    PinResponse,
    Prompt,
    RegisterRequest,
)
from kvserve.entrypoints.front_door import UpstreamKeys, openai_error
from kvserve.entrypoints.openai.tenants import bearer_keys
from kvserve.kvcache.control import ControlClient, ControlError
from kvserve.utils.kv_secret import add_kv_secret_arg, read_kv_secret
from kvserve.utils.zmq_curve import PLAIN_SOCKETS, SocketSecurity, socket_security

logger = logging.getLogger(__name__)

REGISTER_TIMEOUT_S = 10.0
HEALTH_TIMEOUT_S = 2.0
# Taken under the index's lock: a silent instance must not hold lookups up for long.
INVENTORY_TIMEOUT_S = 5.0


class ControllerError(Exception):
    def __init__(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


class CacheController:
    def __init__(
        self,
        upstream_keys: UpstreamKeys | None = None,
        security: SocketSecurity = PLAIN_SOCKETS,
    ) -> None:
        self.keys = upstream_keys or UpstreamKeys()
        self.security = security
        self.index = TierIndex()
        self.lock = threading.Lock()
        self.followers = StreamFollowers(self.index, self.lock, self.resync, security)
        self.instances: dict[str, Instance] = {}
        self.http = httpx.Client(timeout=httpx.Timeout(30.0, connect=5.0))

    # --- instances ------------------------------------------------------------------

    def register(self, req: RegisterRequest) -> Instance:
        name = req.url.rstrip("/")
        control = ControlClient(req.control, security=self.security)
        try:
            info = control.info(timeout_s=REGISTER_TIMEOUT_S)
        except ControlError as exc:
            control.close()
            raise ControllerError(502, f"control: {exc}", "BadGatewayError") from None
        streams: dict[str, list[str]] = {}
        if req.tier_events is not None:
            streams[req.tier_events] = list(info.media)
        if req.kv_events is not None:
            streams[req.kv_events] = [DEVICE]
        layout = HashLayout(
            req.block_size,
            req.prefix_caching_hash_seed,
            info.chunk_size,
            info.hash_seed,
            info.save_unfull_chunk,
        )
        instance = Instance(name, name, control, info, layout, streams)
        self.unregister(name)  # registering again starts afresh
        with self.lock:
            self.instances[name] = instance
        self.followers.start(instance)
        # What it held before: listed once subscribed, and again on each stream's first
        # batch (a SUB socket's subscription takes a moment to reach the publisher).
        self.resync(name)
        logger.info("registered %s (tiers %s)", name, ", ".join(instance.tiers))
        return instance

    def resync(self, name: str) -> None:
        """Takes what the instance's tiers hold now from its control service. Under the
        lock: an event published after the listing waits, and then applies on top of it."""
        with self.lock:
            instance = self.instances.get(name)
            if instance is None:
                return
            try:
                inventory = instance.control.inventory(INVENTORY_TIMEOUT_S)
            except ControlError as exc:
                logger.warning("%s: cannot list its tiers: %s", name, exc)
                return
            for tier, hashes in inventory.items():
                self.index.replace(name, tier, hashes)

    def unregister(self, name: str) -> None:
        with self.lock:
            old = self.instances.pop(name, None)
            self.index.forget(name)
        if old is not None:
            self.followers.stop(old)
            old.control.close()

    def instance(self, name: str, field: str) -> Instance:
        with self.lock:
            found = self.instances.get(name.rstrip("/"))
        if found is None:
            raise ControllerError(
                404, f"{field}: no instance {name!r} is registered", "NotFoundError"
            )
        return found

    def describe(self) -> list[InstanceInfo]:
        with self.lock:
            return [
                InstanceInfo(
                    name=i.name, url=i.url, control=i.control.endpoint, model=i.info.model_name,
                    block_size=i.layout.block_size, chunk_size=i.layout.chunk_size,
                    tiers=i.tiers, held=self.index.counts(i.name),
                )
                for i in self.instances.values()
            ]  # fmt: skip

    # --- operations -----------------------------------------------------------------

    def tokens(self, prompt: Prompt, via: Instance | None = None) -> list[int]:
        """The prompt's token ids; text is tokenized by ``via`` (else any instance)."""
        if prompt.tokens is not None:
            return prompt.tokens
        candidates = [via] if via is not None else list(self.instances.values())
        for instance in candidates:
            try:
                answer = self.http.post(
                    f"{instance.url}/tokenize",
                    json={"prompt": prompt.text, "add_special_tokens": True},
                    headers=self.keys.headers(instance.url),
                )
            except httpx.TransportError as exc:
                logger.warning("%s cannot tokenize: %r", instance.name, exc)
                continue
            if answer.status_code != 200:
                raise ControllerError(400, f"text: {instance.name} refused it: {answer.text}")
            return list(answer.json()["tokens"])
        raise ControllerError(502, "text: no instance could tokenize it", "BadGatewayError")

    def lookup(self, prompt: Prompt) -> LookupResponse:
        tokens = self.tokens(prompt)
        with self.lock:
            layouts = {name: i.layout for name, i in self.instances.items()}
        # Hashed once per layout (a fleet usually shares one), outside the lock.
        hashed = {
            layout: layout.hash(tokens, prompt.cache_salt) for layout in set(layouts.values())
        }
        with self.lock:
            found = {
                name: self.index.match(name, hashed[layout])
                for name, layout in layouts.items()
                if name in self.instances
            }
        return LookupResponse(num_tokens=len(tokens), instances=found)

    def pin(self, req: PinRequest, unpin: bool = False) -> PinResponse:
        instance = self.instance(req.instance, "instance")
        tokens = self.tokens(req, instance)
        tags = _tags(req.cache_salt)
        n = self._control(lambda: instance.control.pin(tokens, req.tier, tags, unpin))
        return PinResponse(instance=instance.name, tier=req.tier, num_tokens=n)

    def clear(self, req: ClearRequest) -> None:
        instance = self.instance(req.instance, "instance")
        self._control(lambda: instance.control.clear(req.tier))

    def move(self, req: MoveRequest) -> MoveResponse:
        source = self.instance(req.source, "source")
        target = self.instance(req.target, "target")
        if source is target and req.source_tier == req.target_tier:
            raise ControllerError(400, "target: the source tier itself; nothing to move")
        tokens = self.tokens(req, source)
        chunks = self._control(
            lambda: source.control.export(tokens, req.source_tier, _tags(req.cache_salt))
        )
        stored, rejected = (0, 0)
        if chunks:
            stored, rejected = self._control(
                lambda: target.control.import_chunks(chunks, req.target_tier)
            )
        return MoveResponse(num_tokens=stored, num_chunks=len(chunks), rejected=rejected)

    def health(self) -> HealthResponse:
        with self.lock:
            instances = list(self.instances.values())
        status: dict[str, bool] = {}
        for instance in instances:
            try:
                instance.control.info(timeout_s=HEALTH_TIMEOUT_S)
                status[instance.name] = True
            except ControlError:
                status[instance.name] = False
        return HealthResponse(healthy=all(status.values()), instances=status)

    @staticmethod
    def _control(call: Callable[[], Any]) -> Any:
        try:
            return call()
        except ControlError as exc:
            message = str(exc)
            if message.startswith("ValueError: "):  # the instance judged the request
                raise ControllerError(400, message.removeprefix("ValueError: ")) from None
            raise ControllerError(502, message, "BadGatewayError") from None

    def close(self) -> None:
        for name in list(self.instances):
            self.unregister(name)
        self.http.close()


def _tags(cache_salt: str | None) -> tuple[tuple[str, str], ...]:
    # The tier's chunk tags for a request's salt (TieredCacheConnector: _tags).
    return () if cache_salt is None else (("salt", cache_salt),)


def _field_path(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc if p != "body")


def build_app(
    controller: CacheController, keys: Mapping[bytes, str | None] | None = None
) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            controller.close()

    app = FastAPI(title="kvserve cache controller", openapi_url="/openapi.json", lifespan=lifespan)

    if keys:

        @app.middleware("http")
        async def require_key(
            request: Request, call_next: Callable[[Request], Awaitable[Response]]
        ) -> Response:
            if request.url.path == "/health":
                return await call_next(request)
            given = request.headers.get("authorization", "").encode()
            if not any([secrets.compare_digest(given, k) for k in keys]):
                return openai_error(401, "a valid API key is required", "AuthenticationError")
            return await call_next(request)

    @app.exception_handler(ControllerError)
    async def controller_error(_: Request, exc: ControllerError) -> JSONResponse:
        return openai_error(exc.status, str(exc), exc.kind)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        message = "; ".join(
            f"{_field_path(tuple(e.get('loc', ()))) or 'body'}: {e['msg']}" for e in errors
        )
        return openai_error(400, message or "invalid request", "BadRequestError")

    # Plain `def` routes: FastAPI runs them in its thread pool, where the blocking ZMQ
    # and HTTP calls to the instances belong.
    @app.post("/register")
    def register(req: RegisterRequest) -> InstanceInfo:
        name = controller.register(req).name
        return next(i for i in controller.describe() if i.name == name)

    @app.post("/deregister")
    def deregister(req: DeregisterRequest) -> dict[str, str]:
        instance = controller.instance(req.url, "url")  # 404 for one not registered
        controller.unregister(instance.name)
        return {"url": instance.name, "status": "deregistered"}

    @app.get("/instances")
    def instances() -> list[InstanceInfo]:
        return controller.describe()

    @app.post("/lookup")
    def lookup(req: Prompt) -> LookupResponse:
        return controller.lookup(req)

    @app.post("/pin")
    def pin(req: PinRequest) -> PinResponse:
        return controller.pin(req)

    @app.post("/unpin")
    def unpin(req: PinRequest) -> PinResponse:
        return controller.pin(req, unpin=True)

    @app.post("/clear")
    def clear(req: ClearRequest) -> dict[str, str]:
        controller.clear(req)
        return {"instance": req.instance, "tier": req.tier, "status": "cleared"}

    @app.post("/move")
    def move(req: MoveRequest) -> MoveResponse:
        return controller.move(req)

    @app.get("/health")
    def health() -> HealthResponse:
        return controller.health()

    return app


def add_cache_controller_parser(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(
        "cache-controller",
        help="track and manage the KV tiers of several instances (lookup, pin, clear, move)",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument(
        "--api-key", default=None, help="require `Authorization: Bearer <key>` but on /health"
    )
    parser.add_argument(
        "--backend-api-key", action="append", default=[], metavar="KEY|URL=KEY",
        help="the key sent to the instances' /tokenize (their --api-key): one for all, or "
        "URL=KEY per instance; repeat",
    )  # fmt: skip
    add_kv_secret_arg(parser)
    parser.set_defaults(func=cache_controller_main)


def cache_controller_main(args: argparse.Namespace) -> int:
    import uvicorn

    controller = CacheController(
        UpstreamKeys(args.backend_api_key), socket_security(read_kv_secret(args.kv_secret_file))
    )
    app = build_app(controller, bearer_keys(args.api_key, None))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
