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

`widen_receive_window` is no patch but reads and writes yamux's private stream
state, so it lives here and is reviewed with them. net/dht.py and net/gossip.py
also use private attributes of KadDHT and Pubsub instances (each marked "private
in the pinned 0.8.1"): review those too.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os

import trio

from ..errors import UnsupportedLibp2p

PINNED_VERSION = "0.8.1"
PATCHES = (
    "yamux credit at half a window (YamuxStream._auto_tune_and_send_window_update)",
    "yamux env cache (yamux._py_yamux_env, yamux._py_yamux_env_set, PY_YAMUX_RELEASE_ON_READ)",
    "yamux frame size (yamux.MAX_MESSAGE_SIZE)",
    "TCP read buffer (TrioTCPStream.read)",
    "DHT query timeout (kad_dht, peer_routing, provider_store .QUERY_TIMEOUT)",
    "widen_receive_window (YamuxStream window state)",
)

PEER_QUERY_TIMEOUT_S = 3.0  # one DHT request to one peer (py-libp2p: QUERY_TIMEOUT = 10 s)
_RECV_BYTES = 256 * 1024  # what one recv() of the TCP read buffer asks the kernel for at most

_applied = False
_unbuffered_read = None  # TrioTCPStream.read as py-libp2p wrote it (set by apply)


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
    global _applied, _unbuffered_read
    if _applied:
        return
    check_version()
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
    _applied = True


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
