"""What a node hears of capability ads, and at what cost. Pure, no I/O.

Three rules keep a node's ad work proportional to the models it serves or uses,
not to the size of the swarm (protocol revisions 22 and 23, docs/architecture.md):

- **A topic per model.** Ads travel on `AD_TOPIC_PREFIX + model_id` (`ad_topic`); a
  node joins the topics of the models it serves or consumes, and an ad must serve
  the model of the topic it came on.
- **A period that stretches with the topic** (`ad_period`): with n providers on a
  topic each publishes every max(base, n / TARGET_ADS_PER_S) seconds, so a member of
  the topic receives about TARGET_ADS_PER_S ads per second however many there are
  (up to MAX_STRETCHED_PERIOD_S; past TARGET_ADS_PER_S × that many providers of one
  model the rate grows again). Each ad's lifetime follows its own period, so views
  expire a stretched ad no earlier than its publisher meant.
- **Cheap refusals first** (`AdIntake`): before the pubsub signature or any decode,
  a message is dropped when it is too big, not on exactly one topic this node
  follows, or from a sender whose last accepted ad on that topic is under
  MIN_INTERVAL_S old; then an ad already checked (by its sha256 digest, relayed by
  another neighbour, heard on a second topic, or handed out again by a view reply)
  costs a hash and a dictionary look-up, not a signature check and a decode. Both
  caches are bounded (LRU).
"""

from __future__ import annotations

import collections
import hashlib
import math

from .. import wire
from ..errors import PeerMisbehaved
from .ads import AD_PERIOD_S, MAX_AD_BYTES, MAX_STRETCHED_PERIOD_S, CapabilityAd, check_fresh, decode_ad
from .view import MIN_AD_INTERVAL_S

AD_TOPIC_PREFIX = wire.AD_TOPIC_PREFIX
TARGET_ADS_PER_S = 1.0  # ads per second a member of one topic handles, whatever its size (2.0 before revision 23)
MIN_INTERVAL_S = MIN_AD_INTERVAL_S  # a sender's ads on one topic: at most one per this
MAX_VERIFIED = 8192  # digests of ads whose signature and schema passed
MAX_REFUSED = 4096  # (digest, sender) pairs that failed them
MAX_SENDERS = 8192  # (sender, topic) pairs whose last accepted ad time is kept
# GossipSub as net/gossip.py runs it (here, not there, so pure cores such as
# net/scale_model.py can read them without importing trio).
HEARTBEAT_S = 1  # GossipSub's spec default; py-libp2p's own default is 120 s
MESH_DEGREE = (6, 4, 12)  # D, D_low, D_high
# IHAVE goes to this many topic peers outside the mesh each heartbeat, however many
# there are (py-libp2p's default adds a quarter of them: a cost that grew with a
# node's connections, so with the swarm: revision 23).
GOSSIP_LAZY = 6
MAX_VIEW_ADS = 1024  # ads in one /compushare/view reply


def ad_topic(model_id: str) -> str:
    """The gossip topic of `model_id`'s ads."""
    return AD_TOPIC_PREFIX + model_id


def model_of_topic(topic: str) -> str | None:
    """The model id a topic carries the ads of; None for any other topic."""
    if not topic.startswith(AD_TOPIC_PREFIX):
        return None
    model_id = topic[len(AD_TOPIC_PREFIX):]
    return model_id if len(model_id) == 64 and all(c in "0123456789abcdef" for c in model_id) else None


def ad_period(providers: float, base_s: float = AD_PERIOD_S, *, target_per_s: float = TARGET_ADS_PER_S,
              cap_s: float = MAX_STRETCHED_PERIOD_S) -> float:
    """A provider's ad period on a topic with `providers` publishers (itself included):
    max(base, providers / target), at most `cap_s` (and never below the base)."""
    if not (math.isfinite(base_s) and base_s > 0 and target_per_s > 0):
        raise ValueError("the base period and the target must be positive")
    return max(base_s, min(cap_s, max(providers, 0) / target_per_s))


class _Lru:
    """A dict bounded to `limit` entries, the least recently used dropped first."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._items: collections.OrderedDict = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key):
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def put(self, key, value) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.limit:
            self._items.popitem(last=False)


class AdIntake:
    """A node's gate for ads: the topics it follows, the early drops, the caches.
    Time is passed in (monotonic seconds for the sender pace, unix seconds for ads)."""

    def __init__(self, *, max_verified: int = MAX_VERIFIED, max_refused: int = MAX_REFUSED,
                 max_senders: int = MAX_SENDERS, min_interval_s: float = MIN_INTERVAL_S) -> None:
        self.followed: set[str] = set()  # model ids
        self.min_interval_s = min_interval_s
        self._verified = _Lru(max_verified)  # digest -> CapabilityAd
        self._refused = _Lru(max_refused)  # (digest, sender) -> reason
        self._accepted_at = _Lru(max_senders)  # (sender, topic) -> when its last ad was accepted
        self.counts: collections.Counter = collections.Counter()  # what happened, by name
        # Messages received per topic followed ("other" for the rest: bounded keys).
        self.heard: collections.Counter = collections.Counter()

    # ------------------------------------------------------------------ before any check

    def early_drop(self, size: int, topics: list[str], sender: object, now: float) -> str | None:
        """Why a message is dropped before its pubsub signature is checked or its ad
        decoded; None to go on. Costs no cryptography and no decode."""
        reason: str | None = None
        followed = len(topics) == 1 and model_of_topic(topics[0]) in self.followed
        self.heard[topics[0] if followed else "other"] += 1
        if size > MAX_AD_BYTES:
            reason = "oversized"
        elif len(topics) != 1:
            reason = "not on exactly one topic"
        elif not followed:
            reason = "a topic not followed"
        else:
            last = self._accepted_at.get((sender, topics[0]))
            if last is not None and now - last < self.min_interval_s:
                reason = "too fast"
        if reason is not None:
            self.counts["early: " + reason] += 1
        return reason

    def accepted(self, sender: object, topic: str, now: float) -> None:
        """Record an ad of `sender` taken on `topic` (after every check, so a forged
        message cannot use up its sender's pace)."""
        self._accepted_at.put((sender, topic), now)

    # ------------------------------------------------------------------ the checks, cached

    def check(self, raw: bytes, *, sender: str | None, now: float, topic: str | None = None) -> CapabilityAd:
        """net/ads.parse_ad through the caches, and the topic's model: the ad checked,
        or PeerMisbehaved. The signature and schema are checked once per digest."""
        digest = hashlib.sha256(raw).digest()
        ad = self._verified.get(digest)
        if ad is not None:
            self.counts["cached"] += 1
            if sender is not None and ad.peer_id != sender:
                raise PeerMisbehaved(f"ad names peer {ad.peer_id} but was sent by {sender}")
        else:
            reason = self._refused.get((digest, sender))
            if reason is not None:
                self.counts["refused again"] += 1
                raise PeerMisbehaved(reason)
            try:
                ad = decode_ad(raw, sender=sender)
            except PeerMisbehaved as exc:
                self._refused.put((digest, sender), str(exc))
                raise
            self.counts["verified"] += 1
            self._verified.put(digest, ad)
        check_fresh(ad, now)
        if topic is not None:
            model_id = model_of_topic(topic)
            if model_id is None or not ad.serving_of(model_id):
                raise PeerMisbehaved(f"ad on topic {topic[:60]!r} does not serve its model")
        return ad

    def cache_sizes(self) -> dict[str, int]:
        return {"verified": len(self._verified), "refused": len(self._refused), "senders": len(self._accepted_at)}


def served_models(ad: CapabilityAd) -> list[str]:
    """The models an ad serves, each once, in order: the topics it is published on."""
    return list(dict.fromkeys(s.model_id for s in ad.serving))
