"""Karma records: what a peer claims in the DHT about its own receipts. Pure, no I/O.

Key `/cskarma/<peer_id>`, value a sealed envelope (net/signed.py) signed by that
peer. The record commits to the first `count` receipts of the owner's append-only
ledger by their Merkle root, and states the compute they count for and the score
that gives. Anyone can fetch those receipts from the owner (karma/service.py),
recompute both, and reject a record whose figures do not match its evidence.
"""

from __future__ import annotations

import dataclasses
import math
import time

from libp2p.crypto.keys import KeyPair

from .. import wire
from ..errors import PeerMisbehaved
from ..net.signed import SignedRecordValidator, addrs_field, field, newest_valid, open_sealed, seal
from .merkle import merkle_root
from .rules import CLOCK_SKEW_S, Tally, base_score, tally

KARMA_NAMESPACE = wire.KARMA_RECORDS
KARMA_VERSION = 1
MAX_KARMA_RECORD_BYTES = 4 * 1024  # far below the DHT's 1 MiB: the receipts stay with the owner
MAX_ADDRS = 8
SCORE_TOLERANCE = 1e-9
MAX_TTL_S = 2 * 3600.0  # a record lives at most this long past its issue time


def karma_key(peer_id: str) -> str:
    return f"/{KARMA_NAMESPACE}/{peer_id}"


@dataclasses.dataclass(frozen=True)
class KarmaRecord:
    peer_id: str
    seq: int  # strictly increasing per owner; the DHT keeps the highest
    issued: float  # unix seconds: receipts are counted as of this time
    expires: float
    count: int  # receipts committed to: the ledger's first `count`
    root: bytes  # their Merkle root
    compute_ms: float  # what they count for under karma/rules.py
    score: float  # base_score(compute_ms): failure reports are applied by the reader
    addrs: tuple[str, ...] = ()  # where to fetch the receipts from

    def sign(self, key_pair: KeyPair) -> bytes:
        return seal({"v": KARMA_VERSION, "peer": self.peer_id, "seq": self.seq, "issued": self.issued,
                     "expires": self.expires, "count": self.count, "root": self.root,
                     "compute_ms": self.compute_ms, "score": self.score, "addrs": list(self.addrs)}, key_pair)

    def is_live(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) < self.expires


def make_record(peer_id: str, wires: list[bytes], *, seq: int, now: float, ttl_s: float,
                addrs: tuple[str, ...] = ()) -> KarmaRecord:
    counted = tally(wires, peer_id, as_of=now)
    return KarmaRecord(peer_id, seq, now, now + ttl_s, len(wires), merkle_root(wires), counted.compute_ms,
                       base_score(counted.compute_ms), tuple(addrs)[:MAX_ADDRS])


def parse_karma_record(key: str, value: bytes, *, now: float | None = None,
                       allow_expired: bool = False) -> KarmaRecord:
    """Signature, then schema, then freshness; raise PeerMisbehaved."""
    parts = key.split("/")
    if len(parts) != 3 or parts[0] != "" or parts[1] != KARMA_NAMESPACE:
        raise PeerMisbehaved(f"not a karma record key: {key!r}")
    body = open_sealed(value, parts[2], max_bytes=MAX_KARMA_RECORD_BYTES, what="karma record")
    if body.get("v") != KARMA_VERSION:
        raise PeerMisbehaved("karma record of an unknown version")
    what = "karma record"
    record = KarmaRecord(
        peer_id=field(body, "peer", str, what), seq=field(body, "seq", int, what),
        issued=float(field(body, "issued", (int, float), what)),
        expires=float(field(body, "expires", (int, float), what)), count=field(body, "count", int, what),
        root=field(body, "root", bytes, what), compute_ms=float(field(body, "compute_ms", (int, float), what)),
        score=float(field(body, "score", (int, float), what)),
        addrs=addrs_field(body, what, max_addrs=MAX_ADDRS),
    )
    if record.peer_id != parts[2]:
        raise PeerMisbehaved("karma record body disagrees with its key")
    if not (record.count >= 0 and len(record.root) == 32
            and all(math.isfinite(x) for x in (record.issued, record.expires, record.compute_ms, record.score))
            and record.compute_ms >= 0):
        raise PeerMisbehaved("karma record fields out of range")
    if abs(record.score - base_score(record.compute_ms)) > SCORE_TOLERANCE:
        raise PeerMisbehaved(f"karma record score {record.score} is not 1 + ln(1 + {record.compute_ms:.0f} ms)")
    now = time.time() if now is None else now
    if record.issued > now + CLOCK_SKEW_S or record.expires - record.issued > MAX_TTL_S:
        raise PeerMisbehaved("karma record issued in the future or living too long")
    if not allow_expired and not record.is_live(now):
        raise PeerMisbehaved("karma record has expired")
    return record


def check_evidence(record: KarmaRecord, wires: list[bytes]) -> Tally:
    """Raise PeerMisbehaved unless `wires` are the receipts the record commits to
    and count for exactly the compute it claims; return their tally."""
    if len(wires) != record.count or merkle_root(wires) != record.root:
        raise PeerMisbehaved(f"the evidence of {record.peer_id} does not match its record's Merkle root")
    counted = tally(wires, record.peer_id, as_of=record.issued)
    if abs(counted.compute_ms - record.compute_ms) > 1e-6 * max(1.0, record.compute_ms):
        raise PeerMisbehaved(f"the record of {record.peer_id} claims {record.compute_ms:.0f} ms of compute; "
                             f"its receipts count for {counted.compute_ms:.0f} ms")
    return counted


def newest_karma_index(key: str, values: list[bytes]) -> int:
    """DHT select(): the valid record with the highest seq wins."""
    return newest_valid(values, lambda value: parse_karma_record(key, value, allow_expired=True))


def karma_validators() -> dict[str, SignedRecordValidator]:
    """The DHT validator of karma records, by namespace: every node hands it to
    net/dht.open_dht (with strict validation, a DHT takes no record it cannot check)."""
    return {KARMA_NAMESPACE: SignedRecordValidator(parse_karma_record, newest_karma_index)}
