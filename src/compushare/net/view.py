"""A node's live view of the swarm, built from capability ads. Pure, no I/O.

The view keeps the newest valid ad of every peer and forgets a peer when that ad
expires. It enforces what one ad cannot show by itself: a peer may not replay an
older ad (seq must grow) nor advertise faster than MIN_AD_INTERVAL_S. Publishers
space their ads PUBLISH_INTERVAL_S apart, twice the rule, so an ad that travelled a
longer path than the previous one is not mistaken for a flood. The view holds at
most MAX_PEERS peers: a flood of fresh identities cannot grow it without bound.
"""

from __future__ import annotations

import dataclasses

from .ads import CapabilityAd, Serving

MIN_AD_INTERVAL_S = 0.5
PUBLISH_INTERVAL_S = 2 * MIN_AD_INTERVAL_S
MAX_PEERS = 4096


@dataclasses.dataclass(frozen=True)
class Offer:
    accepted: bool
    reason: str = ""


@dataclasses.dataclass
class _Entry:
    ad: CapabilityAd
    received: float  # the receiver's clock (unix seconds)


class SwarmView:
    def __init__(self, *, min_interval_s: float = MIN_AD_INTERVAL_S) -> None:
        self.min_interval_s = min_interval_s
        self._peers: dict[str, _Entry] = {}
        self.rejected = 0

    def offer(self, ad: CapabilityAd, now: float) -> Offer:
        """Take a checked ad (net/ads.parse_ad) into the view, or say why not."""
        if not ad.is_live(now):
            return self._reject("expired")
        known = self._peers.get(ad.peer_id)
        if known is None and len(self._peers) >= MAX_PEERS:
            self.expire(now)
            if len(self._peers) >= MAX_PEERS:
                return self._reject(f"the view is full ({MAX_PEERS} peers)")
        if known is not None:
            if ad.seq <= known.ad.seq:
                return self._reject("not newer than the ad already held")
            if now - known.received < self.min_interval_s:
                return self._reject(f"advertising faster than once per {self.min_interval_s:g}s")
        self._peers[ad.peer_id] = _Entry(ad, now)
        return Offer(True)

    def replace(self, ad: CapabilityAd, now: float) -> bool:
        """Take a relayed ad (a view fetched from another node): only seq is checked,
        since the rate rule is about one sender publishing, not about relays."""
        known = self._peers.get(ad.peer_id)
        if not ad.is_live(now) or (known is not None and ad.seq <= known.ad.seq):
            return False
        if known is None and len(self._peers) >= MAX_PEERS:
            return False
        # A relayed copy says nothing of when its sender last published: it must not
        # make the sender's next gossip ad look like a flood.
        self._peers[ad.peer_id] = _Entry(ad, known.received if known else -float("inf"))
        return True

    def _reject(self, reason: str) -> Offer:
        self.rejected += 1
        return Offer(False, reason)

    def expire(self, now: float) -> list[str]:
        gone = [peer for peer, entry in self._peers.items() if not entry.ad.is_live(now)]
        for peer in gone:
            del self._peers[peer]
        return gone

    def get(self, peer_id: str, now: float) -> CapabilityAd | None:
        entry = self._peers.get(peer_id)
        return entry.ad if entry is not None and entry.ad.is_live(now) else None

    def live(self, now: float) -> list[CapabilityAd]:
        return sorted((e.ad for e in self._peers.values() if e.ad.is_live(now)), key=lambda ad: ad.peer_id)

    def servers(self, model_id: str, now: float) -> list[tuple[CapabilityAd, Serving]]:
        return [(ad, s) for ad in self.live(now) for s in ad.serving_of(model_id)]

    def models(self, now: float) -> set[str]:
        return {s.model_id for ad in self.live(now) for s in ad.serving}


def coverage(servers: list[tuple[CapabilityAd, Serving]], num_blocks: int, *,
             exclude: frozenset[str] = frozenset()) -> list[int]:
    """How many servers hold each block."""
    counts = [0] * num_blocks
    for ad, serving in servers:
        if ad.peer_id in exclude:
            continue
        for block in range(serving.start, min(serving.end, num_blocks)):
            counts[block] += 1
    return counts
