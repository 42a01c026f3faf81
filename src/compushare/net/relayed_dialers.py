"""Which host dials NAT'd peers through whom: the seam between net/dial (every dial,
which needs a host's relayed dialler) and net/traversal (which provides one while it
runs). Neither imports the other for it: dial reads this registry, a running
Traversal registers itself here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from libp2p.abc import IHost
from libp2p.peer.id import ID


class RelayedDialer(Protocol):
    async def dial_relayed(self, peer_id: ID, addrs: Sequence[str]) -> None:
        """A connection to `peer_id` through one of its circuit addresses `addrs`."""


_BY_HOST: dict[int, RelayedDialer] = {}


def register(host: IHost, dialer: RelayedDialer) -> None:
    _BY_HOST[id(host)] = dialer


def unregister(host: IHost, dialer: RelayedDialer) -> None:
    if _BY_HOST.get(id(host)) is dialer:
        del _BY_HOST[id(host)]


def relayed_dialer_of(host: IHost) -> RelayedDialer | None:
    """The relayed dialler `host`'s traversal registered, if one is running."""
    return _BY_HOST.get(id(host))
