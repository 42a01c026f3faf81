"""Serving a protocol with per-peer stream caps.

Every protocol a node serves bounds the inbound streams one peer may hold open at
once (and some bound all peers together): otherwise one peer's stalled streams
take the service from everyone. `GuardedHandler` wraps a stream handler with that
bookkeeping:

    handler = GuardedHandler(serve, per_peer=4, total=64, refuse=say_busy)
    host.set_stream_handler(PROTOCOL, handler)

A stream over a cap goes to `refuse(stream, why)` instead of `serve` (the default
resets it); every other stream is counted while `serve` runs, and uncounted when it
returns or raises. `serve` remains the task boundary: it must not raise into
py-libp2p's connection task. Caps given `defence="stream_caps"` are lifted while
that defence is switched off (compushare.defences), for the tests that show them needed.
Streams a peer leaves open once served are bounded below this, per connection
(net/libp2p_patches.py: MAX_ANSWERED_STREAMS).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Awaitable, Callable

from libp2p.abc import INetStream

from .. import defences

Handler = Callable[[INetStream], Awaitable[None]]
Refuse = Callable[[INetStream, str], Awaitable[None]]


async def reset_stream(stream: INetStream, why: str) -> None:
    """The default refusal: reset the stream, say nothing."""
    with contextlib.suppress(Exception):
        await stream.reset()


def peer_of(stream: INetStream) -> str:
    """The remote peer's id (base58) of an inbound stream."""
    return str(stream.muxed_conn.peer_id)


class GuardedHandler:
    """A stream handler that serves at most `per_peer` streams of one peer, and at
    most `total` of all peers together (None: no total cap), at once.

    `open` counts the streams being served, per peer id (peers with none are
    absent); `why` given to `refuse` is one sentence naming the cap that was hit.
    With `defence` (a name of compushare.defences) switched off, nothing is capped.
    """

    def __init__(self, serve: Handler, *, per_peer: int, total: int | None = None,
                 refuse: Refuse = reset_stream, defence: str | None = None) -> None:
        self.serve, self.per_peer, self.total, self.refuse = serve, per_peer, total, refuse
        self.capped = defence is None or not defences.disabled(defence)  # read once, when the protocol is set up
        self.open: collections.Counter[str] = collections.Counter()
        self.open_total = 0

    def over_cap(self, peer: str) -> str | None:
        if self.open[peer] >= self.per_peer:
            return f"{self.per_peer} streams of this peer are open already"
        if self.total is not None and self.open_total >= self.total:
            return f"{self.total} streams are open already"
        return None

    async def __call__(self, stream: INetStream) -> None:
        peer = peer_of(stream)
        why = self.over_cap(peer) if self.capped else None
        if why is not None:
            await self.refuse(stream, why)
            return
        self.open[peer] += 1
        self.open_total += 1
        try:
            await self.serve(stream)
        finally:
            self.open_total -= 1
            self.open[peer] -= 1
            if not self.open[peer]:
                del self.open[peer]
