"""Per-peer rate limits: token buckets keyed by peer id. Pure, no I/O (time is passed in)."""

from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass
class TokenBucket:
    rate: float  # units per second
    burst: float  # bucket size
    level: float = -1.0  # starts full
    stamp: float = 0.0

    def take(self, amount: float, now: float) -> float:
        """Take `amount` if the bucket holds it and return 0; otherwise take nothing
        and return how many seconds until it would."""
        if self.level < 0:
            self.level, self.stamp = self.burst, now
        self.level = min(self.burst, self.level + (now - self.stamp) * self.rate)
        self.stamp = now
        if amount <= self.level:
            self.level -= amount
            return 0.0
        if amount > self.burst:  # can never fit: make it wait for a full bucket
            return (self.burst - self.level) / self.rate + (amount - self.burst) / self.rate
        return (amount - self.level) / self.rate


class PeerRateLimiter:
    """Requests and bytes per peer per second, each a token bucket with a burst of
    `burst_s` seconds' worth. Remembers at most `max_peers` peers (least recent goes)."""

    def __init__(self, requests_per_s: float, bytes_per_s: float, *, burst_s: float = 2.0,
                 max_peers: int = 4096) -> None:
        self.requests_per_s = requests_per_s
        self.bytes_per_s = bytes_per_s
        self.burst_s = burst_s
        self.max_peers = max_peers
        self._peers: collections.OrderedDict[str, tuple[TokenBucket, TokenBucket]] = collections.OrderedDict()

    def check(self, peer: str, nbytes: int, now: float) -> float:
        """0 if the request may go ahead (and is counted), else seconds to wait."""
        buckets = self._peers.pop(peer, None)
        if buckets is None:
            buckets = (TokenBucket(self.requests_per_s, self.requests_per_s * self.burst_s),
                       TokenBucket(self.bytes_per_s, self.bytes_per_s * self.burst_s))
        self._peers[peer] = buckets
        while len(self._peers) > self.max_peers:
            self._peers.popitem(last=False)
        requests, data = buckets
        wait = requests.take(1, now)
        if wait:
            return wait
        wait = data.take(nbytes, now)
        if wait:
            requests.level += 1  # refused: the request is not counted
        return wait
