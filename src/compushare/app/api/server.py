"""Serve the API with Hypercorn inside the caller's trio nursery, on 127.0.0.1 only."""

from __future__ import annotations

import logging
import socket

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

log = logging.getLogger(__name__)


def _listen(port: int) -> socket.socket:
    """A socket on 127.0.0.1:port; a taken port falls back to a free one. Taken shows
    at bind or, with SO_REUSEADDR, only at listen: two nodes starting at once may both
    bind the default port before either listens."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("127.0.0.1", port))
        sock.listen(128)
        return sock
    except OSError as exc:
        sock.close()
        if port == 0:
            raise
        log.warning("API port %d is taken (%s); using a free one", port, exc)
    return _listen(0)


async def serve_api(app, port: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve `app` until cancelled; task_status gets the URL it listens on."""
    config = Config()
    config.bind = [f"fd://{_listen(port).detach()}"]  # bound here: no race for the port
    config.accesslog = None

    async def run(task_status=trio.TASK_STATUS_IGNORED):
        await serve(app, config, task_status=task_status)

    async with trio.open_nursery() as nursery:
        binds = await nursery.start(run)
        task_status.started(binds[0])
