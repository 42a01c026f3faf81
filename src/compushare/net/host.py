"""The one place that creates libp2p hosts (TCP + Noise + yamux), with py-libp2p's
logging tamed and net/libp2p_patches.py applied before the first one starts."""

from __future__ import annotations

import contextlib
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
from libp2p.network.config import ConnectionConfig
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport

from . import libp2p_patches
from .dial import parse_peer_addr  # noqa: F401  (bench/ imports it from here)
from .libp2p_patches import widen_receive_window  # noqa: F401  (bench/ imports it from here)
from .traversal import traversal_of

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 2.0  # closing a stopping host's connections


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


def build_host(key_pair: KeyPair) -> IHost:
    host = _new_host(key_pair)
    _throttle_tag_reaping(host)
    return host


REAP_PERIOD_S = 60.0


def _throttle_tag_reaping(host: IHost) -> None:
    """py-libp2p's pruner, run after every new connection, first walks (and copies)
    every peer its tag store ever held: a cost per connection that grew with the swarm
    (30 % of an idle node's CPU at 65 nodes). Its purpose, dropping stale entries,
    needs doing once a minute, not per connection. (Private in the pinned 0.8.1.)"""
    pruner = host.get_network().connection_pruner
    reap, last = pruner._reap_stale_temp_entries, [-REAP_PERIOD_S]

    def reap_now_and_then() -> None:
        now = trio.current_time()
        if now - last[0] >= REAP_PERIOD_S:
            last[0] = now
            reap()

    pruner._reap_stale_temp_entries = reap_now_and_then


def _new_host(key_pair: KeyPair) -> IHost:
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
    libp2p_patches.apply()  # raises UnsupportedLibp2p on another libp2p version
    quiet_libp2p_logs()
    host = build_host(key_pair)
    quiet_libp2p_logs()  # building the host imports modules that set their own levels
    addrs = [multiaddr.Multiaddr(a) for a in listen]
    async with host.run(listen_addrs=addrs):
        try:
            yield host
        finally:
            # py-libp2p's host leaves its connections open when it stops: a process that
            # goes on (tests, benchmarks, anything hosting several in turn) would keep
            # them, and every relay circuit under them, until it exits.
            # All at once: py-libp2p's yamux close lingers 0.1-0.2 s per connection, which
            # one after another made a consumer's Ctrl-C wait 0.6 s for three servers.
            with trio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
                async with trio.open_nursery() as nursery:
                    for peer in list(host.get_network().connections):
                        nursery.start_soon(_disconnect_quietly, host, peer)


async def _disconnect_quietly(host: IHost, peer) -> None:
    with contextlib.suppress(Exception):
        await host.disconnect(peer)


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


def advertised_addrs(host: IHost) -> list[str]:
    """What this node tells peers to dial: behind NAT, its circuit addresses through
    the relays it holds slots on (net/traversal.py); otherwise its own."""
    traversal = traversal_of(host)
    return traversal.addrs() if traversal is not None else full_addrs(host)
