"""How many hole punches a node makes and how many dials they cost: a budget per
peer and one for all peers together. Pure, no I/O (time is passed in);
net/hole_punch.py asks it before each punch and before each round of its dials.

Any peer that reaches a node over a circuit can start DCUtR and name the addresses
the node then dials, so a punch is an amplifier aimed wherever the peer likes. A
punch dials at most 4 addresses, 3 rounds (12 dials); beyond that:

  per peer   `peer_burst` punches at once (an honest punch is 1 to 3 of them: each
             side's session, and a retry), then one per `peer_interval_s`
  in all     `dial_burst` dials at once, then `dials_per_s` (fresh identities cost
             nothing, so this is what bounds a flood of them)
"""

from __future__ import annotations

import collections
import dataclasses

from .limits import TokenBucket

REFUSALS = ("peer", "total")


@dataclasses.dataclass(frozen=True)
class PunchLimits:
    peer_burst: int = 3
    peer_interval_s: float = 20.0
    dial_burst: int = 48  # four full punches
    dials_per_s: float = 1.0  # 60 a minute
    max_peers: int = 4096  # peers whose budget is remembered (the least recent is forgotten)

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            if getattr(self, field.name) <= 0:
                raise ValueError(f"punch limit {field.name} must be positive")


class PunchBudget:
    """Every method takes `now` (monotonic seconds)."""

    def __init__(self, limits: PunchLimits = PunchLimits()) -> None:
        self.limits = limits
        self._peers: collections.OrderedDict[str, TokenBucket] = collections.OrderedDict()
        self._dials = TokenBucket(limits.dials_per_s, limits.dial_burst)
        self.punches = 0  # punches started
        self.dials = 0  # dials they made
        self.refused: collections.Counter[str] = collections.Counter()  # "peer" or "total" -> refusals

    def punch(self, peer: str, now: float) -> bool:
        """Whether a punch to `peer` may start now (it is counted if so)."""
        bucket = self._peers.pop(peer, None)
        if bucket is None:
            bucket = TokenBucket(1.0 / self.limits.peer_interval_s, self.limits.peer_burst)
        self._peers[peer] = bucket
        while len(self._peers) > self.limits.max_peers:
            self._peers.popitem(last=False)
        if bucket.take(1, now):
            self.refused["peer"] += 1
            return False
        self.punches += 1
        return True

    def dial(self, count: int, now: float) -> bool:
        """Whether a round of `count` dials may go now (they are counted if so)."""
        if self._dials.take(count, now):
            self.refused["total"] += 1
            return False
        self.dials += count
        return True

    def stats(self) -> dict:
        return {"punches": self.punches, "dials": self.dials,
                "refused": {kind: self.refused[kind] for kind in REFUSALS}}
