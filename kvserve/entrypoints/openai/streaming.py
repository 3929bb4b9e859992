"""Bounds on how long a response may hold engine resources: request deadlines and stalls.

A generation holds KV blocks until it finishes. Two things could make that unbounded
from the client's side: a request that runs longer than the operator allows
(``--request-timeout``), and a stream whose reader stops reading (``--stream-stall-timeout``):
then the server's writes block on a full socket, the stream never advances and its
request would sit in the engine until it ran out of tokens. Both end the same way: the
response generator is closed, which aborts the engine request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from fastapi.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from kvserve.entrypoints.openai.protocol import OpenAIServingError, sse_data

logger = logging.getLogger(__name__)


def timeout_error(timeout_s: float) -> OpenAIServingError:
    return OpenAIServingError(
        f"The request did not finish within the server's request timeout of {timeout_s:g} s.",
        status=408,
    )


def openai_error_event(err: OpenAIServingError) -> str:
    """OpenAI's end of a failed stream: the error as a data event, then ``[DONE]``."""
    return sse_data(err.to_response()) + "data: [DONE]\n\n"


async def stream_with_deadline(
    stream: AsyncIterator[str],
    timeout_s: float | None,
    error_event: Callable[[OpenAIServingError], str] = openai_error_event,
) -> AsyncGenerator[str, None]:
    """The SSE lines of ``stream``; past ``timeout_s`` ``error_event`` (in the stream's
    API's shape) ends it.

    Closing this generator closes ``stream`` (and so aborts its engine request).
    """
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    async with contextlib.aclosing(stream):  # type: ignore[type-var]
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    line = await anext(stream)
            except StopAsyncIteration:
                return
            except TimeoutError:
                assert timeout_s is not None
                logger.info("stream ended by the request timeout (%g s)", timeout_s)
                yield error_event(timeout_error(timeout_s))
                return
            yield line


class GuardedStreamingResponse(StreamingResponse):
    """A StreamingResponse that gives up on a reader that stops reading.

    uvicorn's ``send`` waits while the socket's buffers are full; when one write waits
    longer than ``stall_timeout_s`` the response is abandoned (uvicorn then closes the
    connection) and its body iterator is closed in any case, so the generation behind it
    is aborted rather than left running for nobody.
    """

    def __init__(
        self, content: AsyncIterator[str], stall_timeout_s: float | None, **kwargs: object
    ) -> None:
        super().__init__(content, media_type="text/event-stream", **kwargs)  # type: ignore[arg-type]
        self.stall_timeout_s = stall_timeout_s
        self.content = content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stalled = False

        async def bounded_send(message: Message) -> None:
            nonlocal stalled
            try:
                await asyncio.wait_for(send(message), self.stall_timeout_s)
            except TimeoutError:
                stalled = True
                raise

        try:
            await super().__call__(scope, receive, bounded_send)
        except Exception:
            # Starlette re-raises a failed send (TimeoutError is an OSError) as a disconnect.
            if not stalled:
                raise
            logger.warning(
                "client stopped reading its stream for %g s; request aborted",
                self.stall_timeout_s,
            )
        finally:
            aclose = getattr(self.content, "aclose", None)
            if aclose is not None:
                await aclose()
