"""Streamed replies (server-sent events, NDJSON) whose producer is cancelled when the
client hangs up, and plain replies that a client's disconnect cancels too."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

log = logging.getLogger(__name__)

# Room for every message of a generation: a slow reader must never make the
# generation's callbacks block (they run on the event loop, between steps).
STREAM_BUFFER = 8192 + 16


async def _cancel_on_disconnect(receive, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def until_disconnect(receive, work: Awaitable):
    """Run `work`; None if the client disconnected first (then `work` is cancelled)."""
    result = None
    async with trio.open_nursery() as nursery:
        async def run() -> None:
            nonlocal result
            result = await work
            nursery.cancel_scope.cancel()

        nursery.start_soon(run)
        nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
    return result


Producer = Callable[[trio.MemorySendChannel[bytes]], Awaitable[None]]


class Streamed(Response):
    """A 200 whose body `produce` writes message by message. The producer, the sender
    and a watcher for the client's disconnect share one nursery: a client that leaves
    ends the generation (and closes its sessions), never the other way round."""

    def __init__(self, produce: Producer, media_type: str) -> None:
        self.produce, self.content_type = produce, media_type

    async def __call__(self, scope, receive, send) -> None:
        to_client, pending = trio.open_memory_channel[bytes](STREAM_BUFFER)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", self.content_type.encode()), (b"cache-control", b"no-cache")]})
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)

            async def produce() -> None:
                async with to_client:
                    await self.produce(to_client)

            nursery.start_soon(produce)
            try:
                async with pending:
                    async for data in pending:
                        await send({"type": "http.response.body", "body": data, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except Exception as exc:  # the client went away mid-send (Hypercorn's error types vary)
                log.debug("stream ended early: %r", exc)
            nursery.cancel_scope.cancel()  # the watcher


async def answer(request: Request, reply, *, stream: bool, media_type: str,
                 fail: Callable[[BaseException], Response]) -> Response:
    """A prepared generation (`reply`: produce, run, body) streamed, or run to one JSON
    body; a failure as `fail` shapes it; a client that left gets nothing (499)."""
    if stream:
        return Streamed(reply.produce, media_type)
    try:
        outcome = await until_disconnect(request.receive, reply.run())
    except Exception as exc:
        return fail(exc)
    if outcome is None:
        return Response(status_code=499)
    return JSONResponse(reply.body(outcome))
