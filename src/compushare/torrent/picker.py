"""Which piece to ask which peer for. Pure: no I/O, no clock; the caller reports events.

The policy is BitTorrent's, as libtorrent implements it:
- the first few pieces are picked at random (so a newcomer soon has something to
  trade, and peers starting together do not all chase the same piece);
- after that, rarest first: the pieces the fewest connected peers hold;
- no seeder takes more than its fair share of what is missing while others could
  help (in a small download one deep pipeline would otherwise take everything);
- strict endgame: only once every missing piece has been requested may a peer
  with an empty pipeline duplicate requests in flight elsewhere (each piece with
  at most `max_duplicates` extra peers); the first copy to arrive wins and the
  others are cancelled.

A piece that fails its hash check is requested again from someone else (never from
the peer that sent it bad); the sender's pipeline is halved, and after
`max_failures` bad pieces it is banned.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
from collections import Counter
from collections.abc import Hashable, Iterable

Peer = Hashable


@dataclasses.dataclass
class _PeerState:
    has: set[int]
    depth: int
    inflight: set[int] = dataclasses.field(default_factory=set)
    slow: set[int] = dataclasses.field(default_factory=set)  # pieces it timed out on


@dataclasses.dataclass(frozen=True)
class Received:
    accepted: bool  # a wanted piece, first valid copy (counted; others get cancels)
    cancel: dict  # peer -> [piece indexes] requests to cancel (endgame duplicates)
    banned: bool = False  # the sender is banned now: drop its connection


class Picker:
    def __init__(self, wanted: Iterable[int], *, depth: int = 4, random_first: int = 4, max_failures: int = 3,
                 max_duplicates: int = 1, rng: random.Random | None = None) -> None:
        if depth < 1 or max_failures < 1 or max_duplicates < 0:
            raise ValueError("depth and max_failures must be ≥ 1, max_duplicates ≥ 0")
        self.missing: set[int] = set(wanted)
        self.depth, self.random_first = depth, random_first
        self.max_failures, self.max_duplicates = max_failures, max_duplicates
        self.rng = rng or random.Random()
        self.peers: dict[Peer, _PeerState] = {}
        self.banned: set[Peer] = set()
        self.requested: dict[int, set[Peer]] = {}  # piece -> peers it is in flight with
        self.availability: Counter[int] = Counter()  # piece -> connected peers holding it
        self.bad_from: dict[int, set[Peer]] = {}  # piece -> peers that sent it corrupted
        # Kept across reconnections: a peer cannot shed its record by reconnecting.
        self.strikes: Counter[Peer] = Counter()
        self.completed = 0  # pieces received and accepted in this download

    # ------------------------------------------------------------------ state

    @property
    def done(self) -> bool:
        return not self.missing

    def inflight(self, peer: Peer) -> set[int]:
        state = self.peers.get(peer)
        return set(state.inflight) if state else set()

    def failures(self, peer: Peer) -> int:
        return self.strikes[peer]

    def unavailable(self) -> set[int]:
        """Missing pieces that no connected peer can send (but a banned one or a bad sender)."""
        return {i for i in self.missing if not any(i in s.has and peer not in self.bad_from.get(i, ())
                                                   for peer, s in self.peers.items())}

    # ------------------------------------------------------------------ peers

    def add_peer(self, peer: Peer, has: Iterable[int]) -> bool:
        """A peer and its bitfield; False (and ignored) if it is banned or known."""
        if peer in self.banned or peer in self.peers:
            return False
        state = self.peers[peer] = _PeerState(has=set(has), depth=self.depth)
        self.availability.update(state.has)
        return True

    def peer_has(self, peer: Peer, index: int) -> None:
        state = self.peers.get(peer)
        if state is not None and index not in state.has:
            state.has.add(index)
            self.availability[index] += 1

    def remove_peer(self, peer: Peer) -> None:
        state = self.peers.pop(peer, None)
        if state is None:
            return
        self.availability.subtract(state.has)
        for index in state.inflight:
            self._release(peer, index)

    def _release(self, peer: Peer, index: int) -> None:
        holders = self.requested.get(index)
        if holders is not None:
            holders.discard(peer)
            if not holders:
                del self.requested[index]

    # ------------------------------------------------------------------ picking

    def pick(self, peer: Peer) -> list[int]:
        """New requests to send to `peer` (already counted as in flight)."""
        state = self.peers.get(peer)
        if state is None:
            return []
        slots = state.depth - len(state.inflight)
        if slots <= 0:
            return []
        candidates = [i for i in state.has & self.missing
                      if i not in state.inflight and peer not in self.bad_from.get(i, ())]
        fresh = [i for i in candidates if i not in self.requested]
        if state.slow:  # pieces it timed out on go to others first
            fresh = [i for i in fresh if i not in state.slow
                     or not any(i in s.has for p, s in self.peers.items() if p != peer)]
        # A fair share: in a small download one deep pipeline would otherwise take
        # every piece and leave the other seeders idle.
        useful = sum(1 for s in self.peers.values() if not s.has.isdisjoint(self.missing))
        share = max(1, math.ceil(len(self.missing) / max(1, useful))) - len(state.inflight)
        count = max(0, min(slots, share, len(fresh)))
        if self.completed < self.random_first:
            chosen = self.rng.sample(fresh, count)
        else:
            # The `count` rarest (ties broken at random): a partial sort, this runs once per piece per peer.
            chosen = heapq.nsmallest(count, fresh, key=lambda i: (self.availability[i], self.rng.random()))
        if not chosen and not state.inflight and all(i in self.requested for i in self.missing):
            # Strict endgame: a peer with nothing left to do duplicates requests still
            # in flight elsewhere; the first copy wins and the others are cancelled.
            duplicates = [i for i in candidates if len(self.requested[i]) <= self.max_duplicates]
            chosen = sorted(duplicates, key=lambda i: (len(self.requested[i]), self.rng.random()))[:slots]
        for index in chosen:
            state.inflight.add(index)
            self.requested.setdefault(index, set()).add(peer)
        return chosen

    # ------------------------------------------------------------------ events

    def received(self, peer: Peer, index: int, valid: bool) -> Received:
        """A piece arrived from `peer`; `valid` says whether it matched its hash."""
        state = self.peers.get(peer)
        if state is None:
            return Received(False, {})
        asked = index in state.inflight
        state.inflight.discard(index)
        self._release(peer, index)
        if not valid:
            return self._failed(peer, state, index)
        if asked and state.depth < self.depth:
            state.depth += 1  # a slowed-down peer earns its pipeline back piece by piece
        if index not in self.missing:
            return Received(False, {})  # the loser of an endgame race
        # Accepted even if no longer asked for (a request that timed out, then arrived):
        # the data matched its hash, and this peer has just shown it holds the piece.
        self.missing.discard(index)
        self.completed += 1
        cancel = {}
        for other in self.requested.pop(index, set()):
            self.peers[other].inflight.discard(index)
            cancel[other] = [index]
        return Received(True, cancel)

    def _failed(self, peer: Peer, state: _PeerState, index: int) -> Received:
        self.bad_from.setdefault(index, set()).add(peer)
        self.strikes[peer] += 1
        state.depth = max(1, state.depth // 2)
        if self.strikes[peer] < self.max_failures:
            return Received(False, {})
        self.remove_peer(peer)
        self.banned.add(peer)
        return Received(False, {}, banned=True)

    def rejected(self, peer: Peer, index: int, *, not_held: bool = False) -> None:
        """The peer refused a request: it lacks the piece, or we asked too much."""
        state = self.peers.get(peer)
        if state is None:
            return
        state.inflight.discard(index)
        self._release(peer, index)
        if not_held and index in state.has:
            state.has.discard(index)
            self.availability[index] -= 1
        elif not not_held:
            state.depth = max(1, state.depth - 1)

    def timed_out(self, peer: Peer, index: int) -> None:
        """A request went unanswered too long: ask elsewhere (this peer gets that piece
        again only if nobody else has it), and ask this peer for one piece at a time
        until it delivers again."""
        state = self.peers.get(peer)
        if state is None:
            return
        state.inflight.discard(index)
        self._release(peer, index)
        state.depth = 1
        state.slow.add(index)
