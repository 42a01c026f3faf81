"""Every change CompuShare makes to py-libp2p's own code, in one place.

They are written against libp2p 0.8.1 (the version pyproject.toml pins) and reach
into its private parts, so `apply()` refuses any other version: each patch below
must be reviewed against the new code before the pin moves. `apply()` is called by
net/host.open_host, before the first host starts (and by tests that exercise a
patch without a host); it is idempotent.

  yamux credit       WINDOW_UPDATEs batched at half a window, as go-yamux does
  yamux env cache    the PY_YAMUX_* tuning variables read once, not per frame
  yamux frame size   DATA frames that fill exactly one Noise message
  TCP read buffer    one recv() serves many small reads (TrioTCPStream.read)
  DHT query timeout  3 s per DHT request to one peer instead of 10 s
  yamux window       a DATA frame beyond the credit we granted resets its stream;
                     a reset stream's unread data is dropped at once
  yamux stream caps  per connection, at most MAX_INBOUND_STREAMS streams the peer
                     opened, of which MAX_ANSWERED_STREAMS answered and left open
  multistream line   a negotiation message of at most MAX_MULTISTREAM_LINE bytes
  inbound slot       an inbound connection's handler (and its slot of the swarm's
                     inbound cap) ends when the connection does, not with the node
  idle trim          a peer's surplus connections are trimmed only while they carry
                     no stream (a hole punch's direct connection must not cut the
                     relayed one that carries a session)
  handler removed    a protocol handler removed while a stream negotiates it fails
                     that stream, not the node (a NAT'd node leaving DHT server mode)

`widen_receive_window` is no patch but reads and writes yamux's private stream
state, so it lives here and is reviewed with them. net/dht.py and net/gossip.py
also use private attributes of KadDHT and Pubsub instances (each marked "private
in the pinned 0.8.1"): review those too.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.metadata
import logging
import os
import struct
import time

import trio

from .. import defences
from ..errors import UnsupportedLibp2p

log = logging.getLogger(__name__)

PINNED_VERSION = "0.8.1"
PATCHES = (
    "yamux credit at half a window (YamuxStream._auto_tune_and_send_window_update)",
    "yamux env cache (yamux._py_yamux_env, yamux._py_yamux_env_set, PY_YAMUX_RELEASE_ON_READ)",
    "yamux frame size (yamux.MAX_MESSAGE_SIZE)",
    "TCP read buffer (TrioTCPStream.read)",
    "DHT query timeout (kad_dht, peer_routing, provider_store .QUERY_TIMEOUT)",
    "widen_receive_window (YamuxStream window state)",
    "yamux window (YamuxStream.recv_window and .reset_received as descriptors, Yamux.stream_buffers, "
    "Yamux._finalize_stream_locked)",
    "yamux stream caps (Yamux.accept_stream, YamuxStream.close, Yamux.streams)",
    "multistream line (MultiselectCommunicator.read)",
    "inbound slot (Swarm._do_handle_inbound_connection, Swarm.upgrade_inbound_raw_conn, Yamux.event_closed)",
    "idle trim (Swarm._trim_connections, Swarm._close_connection_async, Swarm.cleanup_connection_health)",
    "handler removed (Multiselect.negotiate)",
)

PEER_QUERY_TIMEOUT_S = 3.0  # one DHT request to one peer (py-libp2p: QUERY_TIMEOUT = 10 s)
_RECV_BYTES = 256 * 1024  # what one recv() of the TCP read buffer asks the kernel for at most
MAX_OVERRUNS_PER_CONNECTION = 8  # window overruns (each a stream reset) before the connection is closed
# Streams a peer may hold open on one connection (inbound: the ones it opened). A
# py-libp2p peer never holds more itself (its own per-connection limit on streams it
# opens is 256), so an honest one never meets this cap, even in its bursts of DHT
# queries (measured under a Sybil flood: about 60 at once to one peer).
MAX_INBOUND_STREAMS = 256
# Of those, streams we have answered and closed our side of while the peer keeps its
# side open: nothing reads what the peer sends on them any more. An honest peer
# closes each once it has read the reply; beyond this many the oldest is reset.
MAX_ANSWERED_STREAMS = 16
# Multistream messages are protocol ids and "na" (ours are under 40 bytes).
MAX_MULTISTREAM_LINE = 1024

overruns = 0  # streams reset here because their sender overran its window (for tests and logs)
refused_streams = 0  # inbound streams reset here over MAX_INBOUND_STREAMS
reset_answered = 0  # answered streams reset here over MAX_ANSWERED_STREAMS

_applied = False
_unbuffered_read = None  # TrioTCPStream.read as py-libp2p wrote it (set by apply)
_accept_stream = None  # Yamux.accept_stream as py-libp2p wrote it (set by apply)
_close_stream = None  # YamuxStream.close as py-libp2p wrote it (set by apply)
_read_line = None  # MultiselectCommunicator.read as py-libp2p wrote it (set by apply)
_handle_inbound = None  # Swarm._do_handle_inbound_connection as py-libp2p wrote it (set by apply)
_upgrade_inbound = None  # Swarm.upgrade_inbound_raw_conn as py-libp2p wrote it (set by apply)


def check_version(found: str | None = None) -> None:
    """Raise UnsupportedLibp2p unless the installed libp2p is the one these patches
    were written for."""
    found = importlib.metadata.version("libp2p") if found is None else found
    if found != PINNED_VERSION:
        raise UnsupportedLibp2p(
            f"libp2p {found} is installed, but compushare/net/libp2p_patches.py patches libp2p "
            f"{PINNED_VERSION} (pinned in pyproject.toml). Before moving the pin, review each patch against "
            f"the new version: {'; '.join(PATCHES)}; and the private attributes net/dht.py and "
            f"net/gossip.py use. Or install libp2p=={PINNED_VERSION}.")


def apply() -> None:
    """Check the libp2p version, then patch it (once per process)."""
    global _applied
    if _applied:
        return
    check_version()
    _patch_throughput()
    _patch_stream_bounds()
    _patch_swarm_connections()
    _applied = True


def _patch_throughput() -> None:
    global _unbuffered_read
    from libp2p.io.trio import TrioTCPStream
    from libp2p.kad_dht import kad_dht, peer_routing, provider_store
    from libp2p.security.noise.io import MAX_PLAINTEXT_LENGTH
    from libp2p.stream_muxer.yamux import yamux

    # py-libp2p's yamux sends a WINDOW_UPDATE after every read by default; with it off
    # it batches credit like go-yamux (at half a window), one frame fewer per message.
    os.environ.setdefault("PY_YAMUX_RELEASE_ON_READ", "0")
    # It also re-reads its PY_YAMUX_* tuning variables from os.environ several times per
    # frame, a visible share of a bulk download's CPU; they never change while a process runs.
    yamux._py_yamux_env = functools.cache(yamux._py_yamux_env)
    yamux._py_yamux_env_set = functools.cache(yamux._py_yamux_env_set)
    yamux.YamuxStream._auto_tune_and_send_window_update = _credit_at_half_window

    # py-libp2p's yamux sends DATA frames of up to 64 KiB: with its 12-byte header a
    # full frame is 17 bytes over Noise's largest message, so Noise sent it as two
    # messages, two encryptions and two socket writes, the second of 17 bytes. Frames
    # sized to fill one Noise message exactly raise one stream's bulk rate and lower a
    # seeder's CPU per byte (measured side by side).
    yamux.MAX_MESSAGE_SIZE = MAX_PLAINTEXT_LENGTH

    # py-libp2p reads its TCP socket exactly as much as each layer asks for: Noise's
    # 2-byte length, then the frame (in pieces if it straddles segments). Every read
    # is a recv() plus a trio scheduling round, two or more per frame. Reading what the
    # kernel holds and serving the small reads from that buffer raises one stream's
    # bulk rate markedly on loopback (measured side by side).
    TrioTCPStream._cs_pending = b""  # bytes received and not yet read (a memoryview when set)
    TrioTCPStream._cs_receiving = None  # a trio.Event while one task waits in recv()
    _unbuffered_read = TrioTCPStream.read
    TrioTCPStream.read = _read_buffered

    # Every DHT request to one peer may take QUERY_TIMEOUT, and an iterative look-up
    # waits for its slowest peer: one hung peer stalls every look-up. Each module
    # imported the constant by name, so each is set.
    for module in (kad_dht, peer_routing, provider_store):
        module.QUERY_TIMEOUT = PEER_QUERY_TIMEOUT_S


def _patch_stream_bounds() -> None:
    global _accept_stream, _close_stream, _read_line
    from libp2p.protocol_muxer.multiselect_communicator import MultiselectCommunicator
    from libp2p.stream_muxer.yamux import yamux

    # py-libp2p buffers every DATA frame of a known stream, past the credit it granted
    # too (it logs a warning and sets the credit to 0): a peer could park any amount
    # of memory on a stream nobody reads. Every receive path subtracts a frame from
    # recv_window right after buffering it, so a descriptor sees the overrun there.
    yamux.YamuxStream.recv_window = _ReceiveCredit()
    # py-libp2p keeps what a reset stream had buffered until its sweeper runs, 60-90 s
    # later, though no reader can have it (a reset stream's reads raise): a peer
    # resetting streams it filled would park a window each for that long.
    yamux.YamuxStream.reset_received = _DropOnReset()

    # py-libp2p bounds the streams we open on a connection (256), not those the peer
    # opens: each may park up to a window of data that nothing reads (a stream whose
    # handler has answered and returned, or that never finishes negotiation).
    _accept_stream = yamux.Yamux.accept_stream
    yamux.Yamux.accept_stream = _accept_within_cap
    _close_stream = yamux.YamuxStream.close
    yamux.YamuxStream.close = _close_and_bound_answered

    # py-libp2p reads a negotiation message of whatever length its prefix claims, and
    # credits the stream as it reads: one stream could make the node hold gigabytes
    # until the negotiation deadline (10 s), whatever the caps above.
    _read_line = MultiselectCommunicator.read
    MultiselectCommunicator.read = _read_bounded_line


def _patch_swarm_connections() -> None:
    global _handle_inbound, _upgrade_inbound
    from libp2p.network.swarm import Swarm
    from libp2p.protocol_muxer.exceptions import MultiselectError
    from libp2p.protocol_muxer.multiselect import Multiselect

    # py-libp2p keeps each inbound connection's handler, which holds one of the swarm's
    # 296 inbound slots and the connection's objects, waiting until the node stops,
    # closed connection or not: after 296 inbound connections in its life a node
    # refused every new one (found by a flood of fresh identities).
    _handle_inbound = Swarm._do_handle_inbound_connection
    Swarm._do_handle_inbound_connection = _handle_inbound_until_closed
    _upgrade_inbound = Swarm.upgrade_inbound_raw_conn
    Swarm.upgrade_inbound_raw_conn = _upgrade_and_watch

    # py-libp2p trims a peer's connections beyond max_connections_per_peer at once,
    # the fewest-streams-then-oldest first but busy or not: when a hole punch adds a
    # direct connection to a NAT'd peer, the relayed one, older, went, and with it the
    # inference session it carried. Only idle connections are trimmed here; a busy one
    # stays until its streams end (new streams prefer the direct connection).
    Swarm._trim_connections = _trim_idle_connections

    # py-libp2p's negotiation checks that a handler exists, writes its answer, then
    # looks the handler up again: removed in between (DHT server mode left when
    # AutoNAT finds the node behind NAT), the KeyError escaped every handler and
    # ended the node. It now fails that one stream's negotiation.
    _negotiate = Multiselect.negotiate

    async def negotiate(self, communicator, *args, **kwargs):
        try:
            return await _negotiate(self, communicator, *args, **kwargs)
        except KeyError as exc:
            raise MultiselectError(f"handler of {exc} removed during negotiation") from None

    Multiselect.negotiate = negotiate


def _trim_idle_connections(self, peer_id) -> None:
    connections = self.connections[peer_id]
    surplus = len(connections) - self.connection_config.max_connections_per_peer
    if surplus <= 0:
        return
    now = time.time()
    idle = []
    for conn in connections:
        created = getattr(conn, "_created_at", None)
        if isinstance(created, (int, float)) and now - created < self.connection_config.grace_period:
            continue
        with contextlib.suppress(Exception):
            if conn.get_streams() or self.tag_store.is_protected(peer_id):
                continue
        idle.append(conn)
    idle.sort(key=lambda conn: getattr(conn, "_created_at", 0.0) or 0.0)
    for conn in idle[:surplus]:
        self.cleanup_connection_health(peer_id, conn)
        self.manager.run_task(self._close_connection_async, conn)
    trimmed = {id(conn) for conn in idle[:surplus]}
    self.connections[peer_id] = [conn for conn in connections if id(conn) not in trimmed]


# The cancel scope of the inbound handler running in this task (set by
# _handle_inbound_until_closed for _upgrade_and_watch).
_inbound_handler: contextvars.ContextVar = contextvars.ContextVar("compushare_inbound_handler", default=None)


async def _handle_inbound_until_closed(self, read_write_closer, maddr, failure_event) -> None:
    """py-libp2p's inbound handler, ended (its slot released) once the connection it
    upgraded has closed: _upgrade_and_watch cancels it then."""
    with trio.CancelScope() as scope:
        token = _inbound_handler.set(scope)
        try:
            await _handle_inbound(self, read_write_closer, maddr, failure_event)
        finally:
            _inbound_handler.reset(token)


async def _upgrade_and_watch(self, raw_conn, maddr):
    muxed = await _upgrade_inbound(self, raw_conn, maddr)
    scope, closed = _inbound_handler.get(), getattr(muxed, "event_closed", None)
    if scope is not None and closed is not None:
        async def end_with_connection() -> None:
            await closed.wait()
            scope.cancel()

        self.manager.run_task(end_with_connection)
    return muxed


async def _credit_at_half_window(self, *, bytes_read: int = 0) -> None:
    """go-yamux's sendWindowUpdate: credit the sender only once half the target window
    has been read. py-libp2p 0.8's own version also credits small reads ("partial
    slack"), so a request/reply stream sends a WINDOW_UPDATE frame on every other
    read, and sends it inside read(), before the data reaches the reader: one more
    encrypt-and-send on every message's critical path, and one more frame for the
    peer to wake up for (bench/pipeline_overhead.py shows the cost per hop)."""
    async with self.window_lock:
        buffered = len(self.conn.stream_buffers.get(self.stream_id, b""))
        if self.target_recv_window - (self.recv_window + buffered) < max(self._grow_threshold(), 1):
            return
        delta = self._grow_to_delta(buffered)
        delta += self._apply_autotune_epoch(buffered)  # widen the window for fast readers
    await self.send_window_update(delta, skip_lock=True)


async def _read_buffered(self, n: int | None = None) -> bytes:
    """TrioTCPStream.read with a receive buffer: up to `n` bytes (n=None: any)."""
    if n == 0:
        return b""
    while not self._cs_pending:
        if self._cs_receiving is not None:  # another task is in recv(): its surplus comes first
            await self._cs_receiving.wait()
            continue
        self._cs_receiving = received = trio.Event()
        try:
            data = await _unbuffered_read(self, _RECV_BYTES if n is None else max(n, _RECV_BYTES))
        finally:
            self._cs_receiving = None
            received.set()
        if n is None or len(data) <= n:
            return data
        self._cs_pending = memoryview(data)
    pending = self._cs_pending
    if n is None or n >= len(pending):
        self._cs_pending = b""
        return bytes(pending)
    self._cs_pending = pending[n:]
    return bytes(pending[:n])


async def widen_receive_window(stream, size: int) -> None:
    """Let the peer send up to `size` bytes on `stream` without waiting for credit.

    A yamux stream starts with 256 KiB of credit and py-libp2p's sender, once out of
    credit, polls for more every 10 ms: a downloader asking many pieces at once left
    each seeder stalled in that poll again and again. A reader that bounds what it
    asks for (requests, not a free-running stream) grants that much up front, with
    an ordinary WINDOW_UPDATE."""
    from libp2p.stream_muxer.yamux import yamux

    muxed = getattr(stream, "muxed_stream", None)
    if not isinstance(muxed, yamux.YamuxStream):
        return
    async with muxed.window_lock:
        muxed.target_recv_window = max(muxed.target_recv_window, min(size, yamux.MAX_WINDOW_SIZE))
        delta = muxed.target_recv_window - muxed.recv_window
        if delta <= 0:
            return
        muxed.recv_window += delta
    await muxed.send_window_update(delta, skip_lock=True)  # never under window_lock (py-libp2p's rule)


class _ReceiveCredit:
    """YamuxStream.recv_window, the credit the peer has left on a stream: what we
    granted (256 KiB at the start, plus every WINDOW_UPDATE, which _credit_at_half_window
    and widen_receive_window count here before sending) minus what it sent. A frame
    that takes it below 0 is one the peer had no credit for, which no sender that
    keeps to yamux's flow control sends: the stream is reset and what it buffered
    dropped, instead of py-libp2p's warning and buffering. Stored in the instance's own __dict__ under the
    same name. COMPUSHARE_DISABLE_DEFENCES=yamux_window restores py-libp2p's way."""

    def __get__(self, stream, owner=None):
        if stream is None:
            return self
        return stream.__dict__["recv_window"]

    def __set__(self, stream, value: int) -> None:
        if value < 0 and not defences.disabled("yamux_window"):
            _reset_overrun(stream, -value)
            value = 0
        stream.__dict__["recv_window"] = value


class _DropOnReset:
    """YamuxStream.reset_received; setting it True (an RST from the peer, our own
    reset, the connection's end) also empties the stream's receive buffer, so that
    py-libp2p's finalizing, which follows each of them, drops the stream at once.
    Stored in the instance's __dict__ under the same name; off with yamux_window."""

    def __get__(self, stream, owner=None):
        if stream is None:
            return self
        return stream.__dict__["reset_received"]

    def __set__(self, stream, value: bool) -> None:
        stream.__dict__["reset_received"] = value
        if value and not defences.disabled("yamux_window"):
            buffer = stream.conn.stream_buffers.get(stream.stream_id)
            if buffer:
                buffer.clear()


def _reset_overrun(stream, excess: int) -> None:
    """Called within yamux's frame handler (under streams_lock, no await possible):
    drop the stream's buffer and mark it reset at once; the handler then finalizes a
    closed stream (DATA frames) or the RST task below does (data sent with SYN)."""
    global overruns
    overruns += 1
    conn = stream.conn
    stream.closed = stream.send_closed = stream.recv_closed = True
    stream.reset_received = True  # a reader gets MuxedStreamReset; the buffer is dropped (_DropOnReset)
    event = conn.stream_events.get(stream.stream_id)
    if event is not None:
        event.set()
    if overruns == 1 or overruns % 100 == 0:  # one line per attack, not per stream
        log.info("peer %s sent %d bytes beyond the receive window of stream %d: stream reset (%d so far)",
                 conn.peer_id, excess, stream.stream_id, overruns)
    if conn._nursery is not None:  # the muxer's own nursery, running its frame handler
        conn._nursery.start_soon(_send_reset, stream)
        # A reset costs the peer nothing, and every byte it sends still costs us a
        # decryption: a peer that keeps overrunning loses the connection.
        conn._cs_overruns = getattr(conn, "_cs_overruns", 0) + 1
        if conn._cs_overruns == MAX_OVERRUNS_PER_CONNECTION:
            log.info("peer %s overran %d receive windows: closing its connection", conn.peer_id,
                     MAX_OVERRUNS_PER_CONNECTION)
            conn._nursery.start_soon(_close_quietly, conn)


async def _close_quietly(conn) -> None:
    with contextlib.suppress(Exception):
        await conn.close()


async def _send_reset(stream) -> None:
    from libp2p.stream_muxer.yamux import yamux

    conn = stream.conn
    with contextlib.suppress(Exception):
        await conn._write_frame(struct.pack(yamux.YAMUX_HEADER_FORMAT, 0, yamux.TYPE_WINDOW_UPDATE,
                                            yamux.FLAG_RST, stream.stream_id, 0))
    async with conn.streams_lock:
        if conn.streams.get(stream.stream_id) is stream:  # not yet finalized (a new id is another stream)
            conn._finalize_stream_locked(stream, fully_closed=True)


async def _drop(stream) -> None:
    """Reset a stream we will not serve, and free what it buffered now (a reset
    stream with unread data would otherwise wait for py-libp2p's 60 s sweeper)."""
    buffer = stream.conn.stream_buffers.get(stream.stream_id)
    if buffer is not None:
        buffer.clear()
    with contextlib.suppress(Exception):
        await stream.reset()


async def _accept_within_cap(self):
    """Yamux.accept_stream that resets a peer's new stream while it holds
    MAX_INBOUND_STREAMS others on this connection (counting streams still being
    closed, and those holding unread data). Off with COMPUSHARE_DISABLE_DEFENCES=stream_caps."""
    global refused_streams
    while True:
        stream = await _accept_stream(self)
        if defences.disabled("stream_caps"):
            return stream
        # The peer numbers its streams in the order it opens them: count this one and
        # those it opened before (not those queued behind it, still unaccepted).
        inbound = sum(1 for s in list(self.streams.values())
                      if not s.is_initiator and s.stream_id <= stream.stream_id)
        if inbound <= MAX_INBOUND_STREAMS:
            return stream
        refused_streams += 1
        if refused_streams == 1 or refused_streams % 100 == 0:
            log.info("peer %s holds %d streams on one connection: new ones reset (%d so far)",
                     self.peer_id, inbound - 1, refused_streams)
        await _drop(stream)


async def _close_and_bound_answered(self) -> None:
    """YamuxStream.close; once we have closed our side of a stream the peer opened
    while the peer keeps its own open, the stream is "answered": the peer may hold
    MAX_ANSWERED_STREAMS of them on a connection, and the oldest (peers number
    streams in the order they open them) are reset beyond that. Off with stream_caps."""
    global reset_answered
    await _close_stream(self)
    if self.is_initiator or defences.disabled("stream_caps"):
        return
    buffers = self.conn.stream_buffers
    # Also those the peer closed after filling them: py-libp2p keeps their data 60-90 s.
    answered = sorted((s for s in list(self.conn.streams.values())
                       if not s.is_initiator and s.send_closed and not s.reset_received
                       and (not s.recv_closed or buffers.get(s.stream_id))),
                      key=lambda s: s.stream_id)
    for stream in answered[:max(0, len(answered) - MAX_ANSWERED_STREAMS)]:
        reset_answered += 1
        if reset_answered == 1 or reset_answered % 100 == 0:
            log.info("peer %s left %d answered streams open on one connection: the oldest reset (%d so far)",
                     self.conn.peer_id, len(answered), reset_answered)
        await _drop(stream)


async def _read_bounded_line(self) -> str:
    """MultiselectCommunicator.read with a message of at most MAX_MULTISTREAM_LINE
    bytes (a longer one fails the negotiation, as a malformed one does). Off with
    stream_caps."""
    from libp2p.exceptions import ParseError
    from libp2p.io.exceptions import IOException
    from libp2p.protocol_muxer.exceptions import MultiselectCommunicatorError
    from libp2p.utils import read_varint_prefixed_bytes_limited

    if defences.disabled("stream_caps"):
        return await _read_line(self)
    try:
        data = await read_varint_prefixed_bytes_limited(self.read_writer, MAX_MULTISTREAM_LINE)
    except (ParseError, IOException) as error:  # IOException covers MessageTooLarge
        raise MultiselectCommunicatorError(f"fail to read from multiselect communicator: {error}") from error
    if not data.endswith(b"\n"):
        raise MultiselectCommunicatorError(f"a multistream message not ending in a newline: {data[:40]!r}")
    return data[:-1].decode()
