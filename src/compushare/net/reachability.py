"""Whether this node can be dialled, and how peers reach it if not. Pure, no I/O.

A node learns its reachability from AutoNAT verdicts: other peers try to dial it
back on its own addresses and say whether they got through. A NAT'd node then
reserves slots on a few public relays and advertises circuit addresses through
them (`/<relay addr>/p2p/<relay>/p2p-circuit/p2p/<me>`); peers reach it there at
once and upgrade to a direct connection by hole punching (net/traversal.py).

Everything here decides; net/traversal.py does the dialling and asking.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

PUBLIC, PRIVATE, UNKNOWN = "public", "private", "unknown"
REACHABILITIES = (PUBLIC, PRIVATE, UNKNOWN)
CIRCUIT = "/p2p-circuit"


def is_circuit(addr: str) -> bool:
    return CIRCUIT in addr


def split_addrs(addrs: Iterable[str]) -> tuple[list[str], list[str]]:
    """(direct, relayed) addresses, each in the order given."""
    direct: list[str] = []
    relayed: list[str] = []
    for addr in addrs:
        (relayed if is_circuit(addr) else direct).append(addr)
    return direct, relayed


def relay_of(addr: str) -> str | None:
    """The relay's peer id in a circuit address (the /p2p/ before /p2p-circuit)."""
    if not is_circuit(addr):
        return None
    head = addr[: addr.index(CIRCUIT)]
    if "/p2p/" not in head:
        return None
    return head.rsplit("/p2p/", 1)[1] or None


def circuit_addrs(relay_id: str, relay_addrs: Iterable[str], me: str) -> list[str]:
    """Where peers reach `me` through `relay_id`: one circuit address per address of
    the relay (a relay's own /p2p/ suffix, if any, is replaced by its id)."""
    out = []
    for addr in relay_addrs:
        base = addr.split("/p2p/", 1)[0]
        if not base or is_circuit(addr):
            continue
        out.append(f"{base}/p2p/{relay_id}{CIRCUIT}/p2p/{me}")
    return out


@dataclasses.dataclass
class Verdicts:
    """AutoNAT verdicts about this node, the latest per server, and the status they
    add up to. A status needs `confirmations` agreeing servers (fewer when the swarm
    has fewer servers to ask, but never fewer than one), and a majority; short of
    that the last status stands (one lying server cannot flip it back and forth)."""

    confirmations: int = 3
    max_age_s: float = 600.0
    status: str = UNKNOWN
    _latest: dict[str, tuple[bool, float]] = dataclasses.field(default_factory=dict)

    def record(self, server: str, reachable: bool, now: float) -> None:
        self._latest[server] = (reachable, now)

    def forget(self) -> None:
        """Our addresses changed: every verdict was about the old ones."""
        self._latest.clear()
        self.status = UNKNOWN

    def decide(self, now: float, servers_available: int) -> str:
        fresh = [ok for ok, when in self._latest.values() if now - when <= self.max_age_s]
        need = max(1, min(self.confirmations, servers_available))
        yes = sum(fresh)
        no = len(fresh) - yes
        if yes >= need and yes > no:
            self.status = PUBLIC
        elif no >= need and no > yes:
            self.status = PRIVATE
        return self.status

    def asked(self, now: float) -> set[str]:
        return {server for server, (_ok, when) in self._latest.items() if now - when <= self.max_age_s}


def servers_to_ask(candidates: Sequence[str], asked: set[str], want: int) -> list[str]:
    """Up to `want` AutoNAT servers, those without a fresh verdict first."""
    fresh = [c for c in candidates if c not in asked]
    again = [c for c in candidates if c in asked]
    return (fresh + again)[:want]


@dataclasses.dataclass(frozen=True)
class RelayCandidate:
    peer_id: str
    addrs: tuple[str, ...]
    rtt_s: float | None = None  # None: not measured


def choose_relays(held: Sequence[str], candidates: Sequence[RelayCandidate], want: int,
                  avoid: Iterable[str] = ()) -> list[RelayCandidate]:
    """Which relays to reserve on next so that `want` are held: never one held or
    to `avoid` (recently refused or lost), the nearest measured first, then the
    rest in the order given (the swarm's view: a stable order, not a random one,
    so restarts of a node land on the same relays)."""
    need = want - len(held)
    if need <= 0:
        return []
    skip = set(held) | set(avoid)
    usable = [c for c in candidates if c.peer_id not in skip and c.addrs]
    usable.sort(key=lambda c: (c.rtt_s is None, c.rtt_s or 0.0))
    return usable[:need]


def advertised_addrs(status: str, own: Sequence[str], relayed: Sequence[str], max_addrs: int) -> list[str]:
    """What a node tells the swarm: a publicly reachable (or not yet known) node its
    own addresses; a NAT'd one its circuit addresses first (peers dial those at once)
    and then its own (a peer on the same network may still reach those)."""
    if status == PRIVATE and relayed:
        return (list(relayed) + [a for a in own if a not in relayed])[:max_addrs]
    return list(own)[:max_addrs]
