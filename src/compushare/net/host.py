"""The one place that creates libp2p hosts, with DESIGN.md's work-arounds applied."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
from collections.abc import AsyncIterator, Sequence

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import IHost
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as new_x25519_key_pair
from libp2p.io.trio import TrioTCPStream
from libp2p.network.config import ConnectionConfig
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.security.noise.io import MAX_PLAINTEXT_LENGTH
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux import yamux as _yamux

log = logging.getLogger(__name__)


def quiet_libp2p_logs() -> None:
    """`import libp2p` installs its own handlers and logs every failed dial or
    refused stream (ERROR included) by the dozen; we report what matters ourselves.
    Route its records into ours at $COMPUSHARE_LIBP2P_LOG (default CRITICAL)."""
    level = getattr(logging, os.environ.get("COMPUSHARE_LIBP2P_LOG", "CRITICAL").upper(), logging.CRITICAL)
    lib = logging.getLogger("libp2p")
    lib.handlers.clear()
    lib.propagate = True
    lib.setLevel(level)
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if name.startswith("libp2p.") and isinstance(logger, logging.Logger):
            logger.handlers.clear()
            logger.propagate = True
            logger.setLevel(logging.NOTSET)  # inherit "libp2p"'s level


# py-libp2p's yamux sends a WINDOW_UPDATE after every read by default; with it off
# it batches credit like go-yamux (at half a window), one frame fewer per message.
os.environ.setdefault("PY_YAMUX_RELEASE_ON_READ", "0")
# It also re-reads its PY_YAMUX_* tuning variables from os.environ several times per
# frame (~5 % of a bulk download's CPU); they never change while a process runs.
_yamux._py_yamux_env = functools.cache(_yamux._py_yamux_env)
_yamux._py_yamux_env_set = functools.cache(_yamux._py_yamux_env_set)


async def _credit_at_half_window(self: _yamux.YamuxStream, *, bytes_read: int = 0) -> None:
    """go-yamux's sendWindowUpdate: credit the sender only once half the target window
    has been read. py-libp2p 0.8's own version also credits small reads ("partial
    slack"), so a request/reply stream sends a WINDOW_UPDATE frame on every other
    read, and sends it inside read(), before the data reaches the reader: one more
    encrypt-and-send on every message's critical path, and one more frame for the
    peer to wake up for (bench/pipeline_overhead.py measured ~0.4 ms per hop)."""
    async with self.window_lock:
        buffered = len(self.conn.stream_buffers.get(self.stream_id, b""))
        if self.target_recv_window - (self.recv_window + buffered) < max(self._grow_threshold(), 1):
            return
        delta = self._grow_to_delta(buffered)
        delta += self._apply_autotune_epoch(buffered)  # widen the window for fast readers
    await self.send_window_update(delta, skip_lock=True)


_yamux.YamuxStream._auto_tune_and_send_window_update = _credit_at_half_window

# py-libp2p reads its TCP socket exactly as much as each layer asks for: Noise's
# 2-byte length, then the frame (in pieces if it straddles segments). Every read
# is a recv() plus a trio scheduling round, two or more per frame. Reading what
# the kernel holds, up to this much, and serving the small reads from that buffer
# doubled one stream's bulk rate (80 -> 146 MB/s on loopback, measured side by side).
_RECV_BYTES = 256 * 1024


async def _read_buffered(self: TrioTCPStream, n: int | None = None) -> bytes:
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


TrioTCPStream._cs_pending = b""  # bytes received and not yet read (a memoryview when set)
TrioTCPStream._cs_receiving = None  # a trio.Event while one task waits in recv()
_unbuffered_read = TrioTCPStream.read
TrioTCPStream.read = _read_buffered


# py-libp2p's yamux sends DATA frames of up to 64 KiB: with its 12-byte header a full
# frame is 17 bytes over Noise's largest message, so Noise sent it as two messages,
# two encryptions and two socket writes, the second of 17 bytes. Frames sized to
# fill one Noise message exactly: one stream's bulk rate went from ~150 to ~175 MB/s
# on loopback, and a seeder's CPU per MB from ~11 to ~7 ms (measured side by side).
_yamux.MAX_MESSAGE_SIZE = MAX_PLAINTEXT_LENGTH


async def widen_receive_window(stream, size: int) -> None:
    """Let the peer send up to `size` bytes on `stream` without waiting for credit.

    A yamux stream starts with 256 KiB of credit and py-libp2p's sender, once out
    of credit, polls for more every 10 ms. A downloader asking for 8 MiB of pieces
    at once left each seeder stalled in that poll 16-86 times per 180 MB (measured).
    A reader that bounds what it asks for (requests, not a free-running stream)
    grants that much up front, with an ordinary WINDOW_UPDATE."""
    muxed = getattr(stream, "muxed_stream", None)
    if not isinstance(muxed, _yamux.YamuxStream):
        return
    async with muxed.window_lock:
        muxed.target_recv_window = max(muxed.target_recv_window, min(size, _yamux.MAX_WINDOW_SIZE))
        delta = muxed.target_recv_window - muxed.recv_window
        if delta <= 0:
            return
        muxed.recv_window += delta
    await muxed.send_window_update(delta, skip_lock=True)  # never under window_lock (py-libp2p's rule)


def build_host(key_pair: KeyPair) -> IHost:
    return new_host(
        key_pair=key_pair,
        sec_opt={NOISE_PROTOCOL_ID: NoiseTransport(key_pair, noise_privkey=new_x25519_key_pair().private_key)},
        muxer_preference="YAMUX",
        # Without this every first dial waits an extra 250 ms.
        connection_config=ConnectionConfig(
            max_connections_per_peer=1,
            # The default auto-connector dials up to 200 known peers every 30 s; a
            # node needs only its routing-table neighbours and its chain.
            min_connections=4,
            low_watermark=8,
        ),
        enable_mDNS=False,
    )


@contextlib.asynccontextmanager
async def open_host(key_pair: KeyPair, listen: Sequence[str]) -> AsyncIterator[IHost]:
    """A running host listening on `listen` (empty: dial-only)."""
    quiet_libp2p_logs()
    host = build_host(key_pair)
    quiet_libp2p_logs()  # building the host imports modules that set their own levels
    addrs = [multiaddr.Multiaddr(a) for a in listen]
    async with host.run(listen_addrs=addrs):
        yield host


def local_ipv4_addresses() -> list[str]:
    import psutil

    found = []
    for addrs in psutil.net_if_addrs().values():
        for addr in addrs:
            if addr.family == socket.AF_INET and not addr.address.startswith("169.254."):
                found.append(addr.address)
    return sorted(set(found), key=lambda ip: (ip.startswith("127."), ip))


def expand_unspecified(addr: str, ipv4s: list[str]) -> list[str]:
    """A listener on 0.0.0.0 is reachable on each interface address, never at
    0.0.0.0 itself: advertise those instead (pure, for records and logs)."""
    prefix = "/ip4/0.0.0.0/"
    if not addr.startswith(prefix):
        return [addr]
    return [f"/ip4/{ip}/{addr[len(prefix):]}" for ip in ipv4s]


def full_addrs(host: IHost) -> list[str]:
    """Dialable addresses with the /p2p/<id> suffix, as other peers dial them."""
    peer = host.get_id().to_string()
    out: list[str] = []
    for addr in host.get_addrs():
        text = str(addr)
        if "/p2p/" in text:
            text = text[: text.index("/p2p/")]
        ipv4s = local_ipv4_addresses() if text.startswith("/ip4/0.0.0.0/") else []
        out.extend(f"{a}/p2p/{peer}" for a in expand_unspecified(text, ipv4s))
    return out


def parse_peer_addr(text: str) -> PeerInfo:
    try:
        return info_from_p2p_addr(multiaddr.Multiaddr(text))
    except Exception as exc:
        from ..errors import UsageError

        raise UsageError(f"not a peer multiaddr with /p2p/<id>: {text!r} ({exc})") from None
