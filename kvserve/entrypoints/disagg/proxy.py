"""`kvserve proxy`: one OpenAI-compatible front door over prefill and decode instances.

Each completion or chat request goes first to a prefiller as a copy with max_tokens=1,
stream off and kv_transfer_params naming the decoder chosen for it ({"do_remote_decode":
true, "remote_host", "remote_port", "transfer_id"}); the prefiller computes the prompt and
its KV connector pushes the KV to that decoder. The prefiller's answer carries the
kv_transfer_params the decoder needs; the original request then goes to the decoder with
them, and the decoder's answer (streamed or whole) goes back to the client as it comes. A
client that leaves a stream closes the decoder's connection, which aborts the request
there. Instances are picked by fewest requests in flight, then fewest served; a
prefiller that refuses the connection is skipped for the next one (and tried last for a
few seconds).

Decoders given without a KV address (``--decode URL``) get no kv_transfer_params: the
shape for a shared KV tier (the prefiller stores to Redis or a cache server, the decoder
finds the prompt there). The prefill computes one sample whatever the request's n (the
decoder's samples share its KV); beam search requests and batches of prompts skip the
prefill stage.
"""

from __future__ import annotations

import argparse
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from kvserve.entrypoints.disagg.metrics import ProxyMetrics
from kvserve.entrypoints.disagg.pool import Instance, Pool
from kvserve.entrypoints.front_door import (
    UpstreamKeys,
    add_front_door_auth_args,
    build_front_door_app,
    front_door_keys,
    json_object_body,
    openai_error,
)

logger = logging.getLogger(__name__)

# Fields of the client's request that make no sense for a one-token prefill.
_NOT_FOR_PREFILL = (
    "stream", "stream_options", "max_completion_tokens", "min_tokens", "n", "best_of",
)  # fmt: skip


def disaggregates(body: dict[str, Any]) -> bool:
    """Whether a request goes through the prefill stage: not beam search, and one prompt
    (a batch of prompts would share one transfer between several prompts' KV)."""
    prompt = body.get("prompt")
    batch = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
    return not body.get("use_beam_search") and not batch


class DisaggProxy:
    def __init__(
        self,
        prefill: list[Instance],
        decode: list[Instance],
        upstream_keys: UpstreamKeys | None = None,
    ) -> None:
        self.keys = upstream_keys or UpstreamKeys()
        self.prefill = Pool(prefill, "--prefill")
        self.decode = Pool(decode, "--decode")
        self.metrics = ProxyMetrics()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))

    def prefill_body(self, body: dict[str, Any], decoder: Instance) -> dict[str, Any]:
        prefill = {k: v for k, v in body.items() if k not in _NOT_FOR_PREFILL}
        prefill["max_tokens"] = 1
        prefill["stream"] = False
        if decoder.kv_host is not None:
            prefill["kv_transfer_params"] = {
                "do_remote_decode": True,
                "remote_host": decoder.kv_host,
                "remote_port": decoder.kv_port,
                "transfer_id": uuid.uuid4().hex,
            }
        else:
            prefill.pop("kv_transfer_params", None)
        return prefill

    async def run_prefill(
        self, path: str, body: dict[str, Any], decoder: Instance, request: Request
    ) -> tuple[dict[str, Any] | None, Response | None, str]:
        """(kv_transfer_params for the decoder, an error response to give the client
        instead, the prefiller's URL). A prefiller that cannot be reached has not seen the
        request: the next one is tried."""
        failures: list[str] = []
        for prefiller in self.prefill.by_preference():
            prefiller.in_flight += 1
            start = time.perf_counter()
            try:
                answer = await self.client.post(
                    f"{prefiller.url}{path}",
                    json=self.prefill_body(body, decoder),
                    headers=self.keys.headers(prefiller.url, request),
                )
                break
            except httpx.TransportError as exc:
                prefiller.failed_at = time.monotonic()
                failures.append(f"{prefiller.url}: {exc!r}")
            finally:
                prefiller.in_flight -= 1
        else:
            self.metrics.errors.labels("prefill").inc()
            return (
                None,
                openai_error(503, "no prefill instance answered: " + "; ".join(failures)),
                "",
            )
        prefiller.served += 1
        self.metrics.requests.labels("prefill", prefiller.url).inc()
        self.metrics.stage_seconds.labels("prefill").observe(time.perf_counter() - start)
        if answer.status_code != 200:  # the client's own mistake, most likely: pass it on
            self.metrics.errors.labels("prefill").inc()
            media = answer.headers.get("content-type", "application/json")
            return None, Response(answer.content, answer.status_code, media_type=media), ""
        params = answer.json().get("kv_transfer_params")
        if isinstance(params, dict):
            self.metrics.kv_bytes.inc(float(params.get("kv_bytes", 0) or 0))
            self.metrics.kv_tokens.inc(float(params.get("num_tokens", 0) or 0))
            return params, None, prefiller.url
        return None, None, prefiller.url

    async def forward(self, request: Request, path: str) -> Response:
        start = time.perf_counter()
        body = await json_object_body(request)
        if isinstance(body, Response):
            return body
        decoder = self.decode.pick()
        decoder.in_flight += 1  # held from now: concurrent requests spread over decoders
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                decoder.in_flight -= 1
                self.metrics.stage_seconds.labels("request").observe(time.perf_counter() - start)

        try:
            out_headers = {"x-kvserve-decode": decoder.url}
            decode_body = {k: v for k, v in body.items() if k != "kv_transfer_params"}
            if disaggregates(body):
                params, failed, prefiller = await self.run_prefill(path, body, decoder, request)
                if failed is not None:
                    release()
                    return failed
                out_headers["x-kvserve-prefill"] = prefiller
                if params is not None:
                    decode_body["kv_transfer_params"] = params
            sent = time.perf_counter()
            upstream = await self.client.send(
                self.client.build_request(
                    "POST",
                    f"{decoder.url}{path}",
                    json=decode_body,
                    headers=self.keys.headers(decoder.url, request),
                ),
                stream=True,
            )
        except httpx.TransportError as exc:
            decoder.failed_at = time.monotonic()
            self.metrics.errors.labels("decode").inc()
            release()
            return openai_error(503, f"decode instance {decoder.url} failed: {exc!r}")
        except BaseException:
            release()
            raise
        decoder.served += 1
        self.metrics.requests.labels("decode", decoder.url).inc()
        if upstream.status_code != 200:
            self.metrics.errors.labels("decode").inc()
        media = upstream.headers.get("content-type", "application/json")
        if not body.get("stream"):
            try:
                content = await upstream.aread()
                self.metrics.stage_seconds.labels("decode_first_byte").observe(
                    time.perf_counter() - sent
                )
            finally:
                await upstream.aclose()
                release()
            return Response(content, upstream.status_code, headers=out_headers, media_type=media)
        return StreamingResponse(
            self._relay(upstream, sent, release), upstream.status_code,
            headers=out_headers, media_type=media,
        )  # fmt: skip

    async def _relay(
        self, upstream: httpx.Response, sent: float, release: Any
    ) -> AsyncIterator[bytes]:
        # Closing the upstream stream when the client goes (this generator is cancelled)
        # drops the decoder's connection, which aborts the request there.
        first, finished = True, False
        try:
            async for chunk in upstream.aiter_raw():
                if first:
                    first = False
                    self.metrics.stage_seconds.labels("decode_first_byte").observe(
                        time.perf_counter() - sent
                    )
                yield chunk
            finished = True
        finally:
            if not finished:
                self.metrics.aborts.inc()
            await upstream.aclose()
            release()

    async def models(self) -> Response:
        for instance in self.decode.instances:
            try:
                answer = await self.client.get(
                    f"{instance.url}/v1/models", headers=self.keys.headers(instance.url)
                )
            except httpx.TransportError:
                continue
            return Response(answer.content, answer.status_code, media_type="application/json")
        return openai_error(503, "no decode instance answers")

    def metrics_text(self) -> bytes:
        return self.metrics.text()

    async def is_healthy(self) -> bool:
        """Whether at least one prefiller and one decoder answer /health."""

        async def any_up(pool: Pool) -> bool:
            for instance in pool.instances:
                try:
                    answer = await self.client.get(f"{instance.url}/health", timeout=2.0)
                except httpx.HTTPError:
                    continue
                if answer.status_code == 200:
                    return True
            return False

        return await any_up(self.prefill) and await any_up(self.decode)


def build_app(proxy: DisaggProxy, keys: Mapping[bytes, str | None] | None = None) -> FastAPI:
    @asynccontextmanager
    async def running() -> AsyncIterator[None]:
        try:
            yield
        finally:
            await proxy.client.aclose()

    return build_front_door_app(proxy, running, keys)


def add_proxy_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prefill", action="append", required=True, metavar="URL",
        help="a prefill instance (kv_producer); repeat for several",
    )  # fmt: skip
    parser.add_argument(
        "--decode", action="append", required=True, metavar="URL[=KV_HOST:KV_PORT]",
        help="a decode instance (kv_consumer) and where its P2pZmqConnector listens; "
        "without the address the instances share a KV tier instead; repeat for several",
    )  # fmt: skip


def add_proxy_parser(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(
        "proxy", help="disaggregated prefill: one front door over prefill and decode instances"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    add_proxy_arguments(parser)
    add_front_door_auth_args(parser)
    parser.set_defaults(func=proxy_main)


def make_proxy(args: argparse.Namespace) -> DisaggProxy:
    return DisaggProxy(
        [Instance.parse(spec, "--prefill") for spec in args.prefill],
        [Instance.parse(spec, "--decode") for spec in args.decode],
        UpstreamKeys(args.backend_api_key),
    )


def proxy_main(args: argparse.Namespace) -> int:
    import uvicorn

    app = build_app(make_proxy(args), front_door_keys(args))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
