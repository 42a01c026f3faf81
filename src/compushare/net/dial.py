"""Reaching a peer: multiaddr strings to a PeerInfo, and one dial.

Peers publish their addresses as strings, with or without the /p2p/<peer id>
suffix (server records, capability ads and karma records carry full addresses;
`--bootstrap` must). These are the only conversions from such strings to what
py-libp2p dials, and `dial` is every connection a CompuShare process opens: a
peer behind NAT advertises circuit addresses (net/reachability.py), which are
dialled through the relay at once (by the host's net/traversal, found through
net/relayed_dialers); the hole punch that may
follow is DCUtR's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import multiaddr
import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr

from ..errors import UsageError
from .reachability import is_circuit
from .relayed_dialers import relayed_dialer_of


def peer_info(peer_id: str | ID, addrs: Iterable[str | multiaddr.Multiaddr]) -> PeerInfo:
    """A PeerInfo to dial `peer_id` at `addrs`: each address's /p2p/<peer_id> suffix
    is dropped, an address that does not parse is skipped (another may work)."""
    peer = peer_id if isinstance(peer_id, ID) else ID.from_base58(peer_id)
    suffix = multiaddr.Multiaddr(f"/p2p/{peer.to_base58()}")
    out = []
    for addr in addrs:
        try:
            parsed = addr if isinstance(addr, multiaddr.Multiaddr) else multiaddr.Multiaddr(addr)
        except Exception:  # malformed text from a peer's record or ad
            continue
        with contextlib.suppress(Exception):  # no such suffix: the address is used as it is
            parsed = parsed.decapsulate(suffix)
        out.append(parsed)
    return PeerInfo(peer, out)


def parse_peer_addr(text: str) -> PeerInfo:
    """A full peer address given by the user (`/ip4/.../tcp/.../p2p/<id>`); UsageError
    if it is not one."""
    try:
        return info_from_p2p_addr(multiaddr.Multiaddr(text))
    except Exception as exc:
        raise UsageError(f"not a peer multiaddr with /p2p/<id>: {text!r} ({exc})") from None


async def dial(host: IHost, peer_id: str | ID, addrs: Iterable[str | multiaddr.Multiaddr], *,
               timeout: float) -> PeerInfo:
    """Connect to `peer_id` at `addrs` (a connection it already has will do) within
    `timeout` seconds (trio.TooSlowError), or raise py-libp2p's dial error.

    py-libp2p refuses, for a while, to redial a peer whose addresses all failed once
    (its negative cache): a peer that was still starting, or restarted on new ports,
    would stay unreachable. That refusal is lifted before every dial here."""
    info = peer_info(peer_id, addrs)
    if host.get_network().connections.get(info.peer_id):
        return info
    with contextlib.suppress(Exception):
        host.get_network().unblock_peer(info.peer_id)
    direct = [a for a in info.addrs if not is_circuit(str(a))]
    # A circuit address ends in the peer's id (/p2p-circuit/p2p/<id>): py-libp2p needs it.
    suffix = f"/p2p/{info.peer_id.to_base58()}"
    relayed = [a if a.endswith(suffix) else a + suffix for a in map(str, info.addrs) if is_circuit(a)]
    relaying = relayed_dialer_of(host)
    with trio.fail_after(timeout):
        if relayed and relaying is not None:
            # The peer found itself unreachable (AutoNAT) and said so by advertising
            # circuits: its direct addresses would only time out.
            await relaying.dial_relayed(info.peer_id, relayed)
        else:
            await host.connect(PeerInfo(info.peer_id, direct))
    return info
