"""A node's live view of the swarm, built from capability ads. Pure, no I/O.

The view keeps the newest valid ad of every peer and forgets a peer when that ad
expires. It enforces what one ad cannot show by itself: a peer may not replay an
older ad (seq must grow) nor advertise faster than MIN_AD_INTERVAL_S. Publishers
space their ads PUBLISH_INTERVAL_S apart, twice the rule, so an ad that travelled a
longer path than the previous one is not mistaken for a flood.

Identities are free, so a valid ad proves nothing about its peer. The view is split
(the view policy, defence "view_policy"):

- an *evidenced* part of EVIDENCED_SLOTS peers with evidence of being more than a
  key: this node itself; a live connection to us over which the peer completed
  identify (kept while the peer stays in view); verified karma above a newcomer's;
  or AGE_EVIDENCE_S of continuous presence in the view (at most AGED_SLOTS peers
  hold their place on age alone: ageing in costs an attacker only patience);
- a *newcomer* part of NEWCOMER_SLOTS for everyone else. A newcomer always gets in
  (no gate): when the part is full, it takes the place of a random newcomer.

A flood of fresh identities therefore churns the newcomer part and nothing else:
no newcomer displaces a peer of the evidenced part, nor a peer connected to us or
with karma wherever it is. A peer with connection or karma evidence that finds the
evidenced part full takes the place of the youngest peer there whose only
evidence is age (that peer becomes a newcomer). Evidence is given by the caller
(`note_connected`, `note_karma`, `set_self`) and time is passed in. Replies to
other nodes (`ranked`) put peers with evidence first, the best first, then a
random sample of newcomers: never an order a key can be ground for. Bounded
memory: at most MAX_PEERS ads, and evidence tables of at most MAX_PEERS peer ids
each.

With the policy off (COMPUSHARE_DISABLE_DEFENCES=view_policy) the view is what it
was: first come, refused when MAX_PEERS peers are held, replies by peer id.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import random
from collections.abc import Iterable

from .. import defences
from .ads import CapabilityAd, Serving
from .reachability import PUBLIC, RelayCandidate, is_circuit

MIN_AD_INTERVAL_S = 0.5
PUBLISH_INTERVAL_S = 2 * MIN_AD_INTERVAL_S
MAX_PEERS = 4096
# A view pull (net/gossip.learn_views) asks at most this many connected peers, those
# that serve the model first (revision 23; every connection before).
VIEW_SAMPLE = 8
NEWCOMER_SLOTS = 512
EVIDENCED_SLOTS = MAX_PEERS - NEWCOMER_SLOTS
AGED_SLOTS = MAX_PEERS // 2  # of the evidenced part, at most this many on age alone
# Long enough that a flood churning the newcomer part keeps its own keys from ageing
# in (at 100 fresh keys/s a newcomer lasts ~5 s), short enough that an honest peer
# that never connects to us is evidenced within minutes of a quiet swarm.
AGE_EVIDENCE_S = 300.0

# Evidence, weakest to strongest; `ranked` orders by it.
NONE, AGED, KNOWN, CONNECTED, SELF = range(5)  # KNOWN: was connected, or karma


@dataclasses.dataclass(frozen=True)
class Offer:
    accepted: bool
    reason: str = ""


@dataclasses.dataclass
class _Entry:
    ad: CapabilityAd
    received: float  # the receiver's clock (unix seconds)
    first_seen: float = 0.0  # kept across refreshes: the peer's continuous presence
    was_connected: bool = False
    evidenced: bool = False  # in the evidenced part (else the newcomer part)


class _Bag:
    """A set with O(1) add, remove and uniform random choice."""

    def __init__(self) -> None:
        self._items: list[str] = []
        self._index: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, item: str) -> bool:
        return item in self._index

    def __iter__(self):
        return iter(list(self._items))

    def add(self, item: str) -> None:
        if item not in self._index:
            self._index[item] = len(self._items)
            self._items.append(item)

    def discard(self, item: str) -> None:
        i = self._index.pop(item, None)
        if i is None:
            return
        last = self._items.pop()
        if i < len(self._items):
            self._items[i] = last
            self._index[last] = i

    def choice(self, rng: random.Random) -> str:
        return self._items[rng.randrange(len(self._items))]


class SwarmView:
    def __init__(self, *, min_interval_s: float = MIN_AD_INTERVAL_S, policy: bool | None = None,
                 rng: random.Random | None = None) -> None:
        self.min_interval_s = min_interval_s
        self.policy = not defences.disabled("view_policy") if policy is None else policy
        self.rng = rng or random.Random()
        self._peers: dict[str, _Entry] = {}
        self._newcomers = _Bag()
        self._evidenced: set[str] = set()
        self._self: str | None = None
        self._connected: frozenset[str] = frozenset()
        self._karma: frozenset[str] = frozenset()
        self.rejected = 0
        self.newcomer_ads_dropped = 0  # by gossip, over its budget for ads of peers not in view
        self.displaced = 0  # newcomers that made room for another peer

    # ------------------------------------------------------------------ ads in

    def offer(self, ad: CapabilityAd, now: float) -> Offer:
        """Take a checked ad (net/ads.parse_ad) into the view, or say why not."""
        if not ad.is_live(now):
            return self._reject("expired")
        known = self._peers.get(ad.peer_id)
        if known is not None:
            if ad.seq <= known.ad.seq:
                return self._reject("not newer than the ad already held")
            if now - known.received < self.min_interval_s:
                return self._reject(f"advertising faster than once per {self.min_interval_s:g}s")
            known.ad, known.received = ad, now
            return Offer(True)
        if not self.policy:
            if len(self._peers) >= MAX_PEERS:
                self.expire(now)
                if len(self._peers) >= MAX_PEERS:
                    return self._reject(f"the view is full ({MAX_PEERS} peers)")
            self._peers[ad.peer_id] = _Entry(ad, now, now)
            return Offer(True)
        return self._admit(_Entry(ad, now, now), now, churn=True)

    def replace(self, ad: CapabilityAd, now: float) -> bool:
        """Take a relayed ad (a view fetched from another node): only seq is checked,
        since the rate rule is about one sender publishing, not about relays."""
        known = self._peers.get(ad.peer_id)
        if not ad.is_live(now) or (known is not None and ad.seq <= known.ad.seq):
            return False
        if known is not None:
            known.ad = ad
            return True
        # A relayed copy says nothing of when its sender last published: it must not
        # make the sender's next gossip ad look like a flood.
        entry = _Entry(ad, -float("inf"), now)
        if not self.policy:
            if len(self._peers) >= MAX_PEERS:
                return False
            self._peers[ad.peer_id] = entry
            return True
        # Relayed newcomers do not churn: a reply lists the relay's evidenced peers
        # first, and a reply full of Sybils must not push those out again.
        return self._admit(entry, now, churn=False).accepted

    def _admit(self, entry: _Entry, now: float, *, churn: bool) -> Offer:
        peer = entry.ad.peer_id
        entry.was_connected = peer in self._connected
        level = self._level(peer, entry, now)  # never AGED: it was first seen now
        if level > NONE and self._make_room_evidenced(level, self._aged_only(now) if len(
                self._evidenced) >= EVIDENCED_SLOTS else [], now):
            self._peers[peer] = entry
            self._evidenced.add(peer)
            entry.evidenced = True
            return Offer(True)
        if len(self._newcomers) >= NEWCOMER_SLOTS:
            if not churn:
                return self._reject(f"the newcomer part is full ({NEWCOMER_SLOTS} peers)")
            if not self._displace_newcomer(now):
                return self._reject("the view is full of peers with evidence")
        self._peers[peer] = entry
        self._newcomers.add(peer)
        return Offer(True)

    def _displace_newcomer(self, now: float) -> bool:
        """Drop a random newcomer that has neither connection nor karma evidence (age
        counts only in the evidenced part); False if there is none."""
        for _ in range(4):  # almost always one of these
            peer = self._newcomers.choice(self.rng)
            if self._level(peer, self._peers[peer], now) <= AGED:
                break
        else:
            bare = [p for p in self._newcomers if self._level(p, self._peers[p], now) <= AGED]
            if not bare:
                return False
            peer = self.rng.choice(bare)
        self._drop(peer)
        self.displaced += 1
        return True

    def _make_room_evidenced(self, level: int, aged: list[str], now: float) -> bool:
        """Whether a peer of evidence `level` can join the evidenced part. `aged`: the
        age-only peers there, youngest last (kept up to date). Age alone joins while
        the part and the AGED_SLOTS for age have room; connection or karma evidence
        that finds the part full moves the youngest age-only peer to the newcomer part."""
        if level == AGED:
            return len(self._evidenced) < EVIDENCED_SLOTS and len(aged) < AGED_SLOTS
        if len(self._evidenced) < EVIDENCED_SLOTS:
            return True
        if not aged:
            return False
        self._demote(aged.pop(), now)
        return True

    def _aged_only(self, now: float) -> list[str]:
        """Evidenced peers whose only evidence is age, the youngest last."""
        aged = [p for p in self._evidenced if self._level(p, self._peers[p], now) == AGED]
        return sorted(aged, key=lambda p: (self._peers[p].first_seen, p))

    def _demote(self, peer: str, now: float) -> None:
        """Move an evidenced peer to the newcomer part, where it may be displaced."""
        self._evidenced.discard(peer)
        self._peers[peer].evidenced = False
        if len(self._newcomers) >= NEWCOMER_SLOTS:  # room for it, unless every newcomer is connected
            if not self._displace_newcomer(now):
                self._drop(peer)
                return
        self._newcomers.add(peer)

    def _drop(self, peer: str) -> None:
        self._peers.pop(peer, None)
        self._newcomers.discard(peer)
        self._evidenced.discard(peer)

    def _reject(self, reason: str) -> Offer:
        self.rejected += 1
        return Offer(False, reason)

    # ------------------------------------------------------------------ evidence in

    def set_self(self, peer_id: str) -> None:
        self._self = peer_id

    def note_connected(self, peers: Iterable[str], now: float) -> None:
        """The peers connected to us now that completed identify (replaces the last
        call's set). Each keeps this evidence for as long as it stays in view."""
        self._connected = frozenset(itertools.islice(peers, MAX_PEERS))
        for peer in self._connected:
            entry = self._peers.get(peer)
            if entry is not None:
                entry.was_connected = True
        self.settle(now)

    def note_karma(self, peers: Iterable[str], now: float) -> None:
        """The peers whose karma was verified above a newcomer's (replaces the last set)."""
        self._karma = frozenset(itertools.islice(peers, MAX_PEERS))
        self.settle(now)

    def _level(self, peer: str, entry: _Entry, now: float) -> int:
        if peer == self._self:
            return SELF
        if peer in self._connected:
            return CONNECTED
        if entry.was_connected or peer in self._karma:
            return KNOWN
        if now - entry.first_seen >= AGE_EVIDENCE_S:
            return AGED
        return NONE

    def evidence(self, peer_id: str, now: float) -> int:
        """The evidence held for a peer in view (NONE ... SELF); NONE if not in view."""
        entry = self._peers.get(peer_id)
        return self._level(peer_id, entry, now) if entry is not None else NONE

    def settle(self, now: float) -> None:
        """Move peers between the parts as their evidence changed: newcomers that
        gained evidence join the evidenced part where there is room (strongest, then
        oldest first); evidenced peers that lost it (karma withdrawn) become newcomers,
        as do the youngest age-only peers beyond AGED_SLOTS."""
        if not self.policy:
            return
        for peer in [p for p in self._evidenced if self._level(p, self._peers[p], now) == NONE]:
            self._demote(peer, now)
        aged = self._aged_only(now)
        while len(aged) > AGED_SLOTS:
            self._demote(aged.pop(), now)
        rising = [(self._level(p, self._peers[p], now), p) for p in self._newcomers]
        rising.sort(key=lambda item: (-item[0], self._peers[item[1]].first_seen, item[1]))
        for level, peer in rising:
            if level == NONE:
                break
            if peer not in self._newcomers or not self._make_room_evidenced(level, aged, now):
                continue  # displaced meanwhile, or no room
            self._newcomers.discard(peer)
            self._evidenced.add(peer)
            self._peers[peer].evidenced = True
            if level == AGED:
                bisect.insort(aged, peer, key=lambda p: (self._peers[p].first_seen, p))

    # ------------------------------------------------------------------ reads

    def expire(self, now: float) -> list[str]:
        gone = [peer for peer, entry in self._peers.items() if not entry.ad.is_live(now)]
        for peer in gone:
            self._drop(peer)
        self.settle(now)
        return gone

    def sample_for(self, peers: list[str], model_id: str | None, now: float, size: int = VIEW_SAMPLE) -> list[str]:
        """Up to `size` of `peers` to ask for their views: those whose live ads serve
        `model_id` first (they follow its topic, so hold its ads), each part in random order."""
        def serves(peer: str) -> bool:
            ad = self.get(peer, now) if model_id is not None else None
            return ad is not None and bool(ad.serving_of(model_id))

        return sorted(self.rng.sample(peers, len(peers)), key=lambda peer: not serves(peer))[:size]

    def get(self, peer_id: str, now: float) -> CapabilityAd | None:
        entry = self._peers.get(peer_id)
        return entry.ad if entry is not None and entry.ad.is_live(now) else None

    def live(self, now: float) -> list[CapabilityAd]:
        return sorted((e.ad for e in self._peers.values() if e.ad.is_live(now)), key=lambda ad: ad.peer_id)

    def ranked(self, now: float, limit: int) -> list[CapabilityAd]:
        """At most `limit` live ads for others (the view protocol's reply): peers with
        evidence first, the strongest and then the longest present first, then a
        random sample of newcomers. With the policy off: the first by peer id."""
        if not self.policy:
            return self.live(now)[:limit]
        levels = {p: self._level(p, e, now) for p, e in self._peers.items() if e.ad.is_live(now)}
        best = sorted((p for p, level in levels.items() if level > NONE),
                      key=lambda p: (-levels[p], self._peers[p].first_seen, p))[:limit]
        rest = [p for p, level in levels.items() if level == NONE]
        best += self.rng.sample(rest, min(len(rest), limit - len(best)))
        return [self._peers[p].ad for p in best]

    def counts(self) -> dict[str, int]:
        return {"peers": len(self._peers), "evidenced": len(self._evidenced), "newcomers": len(self._newcomers)}

    def servers(self, model_id: str, now: float) -> list[tuple[CapabilityAd, Serving]]:
        return [(ad, s) for ad in self.live(now) for s in ad.serving_of(model_id)]

    def providers(self, model_id: str, now: float) -> int:
        """How many peers in view serve `model_id`: the size of its ad topic."""
        return sum(1 for e in self._peers.values() if e.ad.is_live(now) and e.ad.serving_of(model_id))

    def holds(self, ad: CapabilityAd) -> bool:
        """Whether this very ad (same peer, same seq) is the one held for its peer."""
        entry = self._peers.get(ad.peer_id)
        return entry is not None and entry.ad.seq == ad.seq and entry.ad.raw == ad.raw

    def models(self, now: float) -> set[str]:
        return {s.model_id for ad in self.live(now) for s in ad.serving}


def relay_candidates(view: SwarmView, me: str, now: float) -> list[RelayCandidate]:
    """Relays a NAT'd node may reserve on: peers whose ads say they relay (they are
    publicly reachable by their own AutoNAT), peers with evidence first (the view's
    ranking), so that a flood of Sybil ads does not decide where a node's traffic goes."""
    return [RelayCandidate(ad.peer_id, tuple(a for a in ad.addrs if not is_circuit(a)))
            for ad in view.ranked(now, MAX_PEERS)
            if ad.peer_id != me and ad.relay and ad.reach == PUBLIC]


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
