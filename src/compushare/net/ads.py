"""Capability ads: what a node tells the swarm over GossipSub. Pure, no I/O.

An ad is a sealed envelope (net/signed.py) signed by the peer it describes: its
addresses, hardware, software version and, per model span it serves, free KV
tokens, load and measured speed. Providers publish one on the topic of each model
they serve every period (AD_PERIOD_S, stretched as the topic grows: net/ad_intake.py;
at once after a change); an ad expires three of its publisher's periods after it was
sent (at most MAX_AD_TTL_S), so a peer that stops advertising drops out of every view
within that bound.

Checks, in order: size, envelope and signature (the signer must be the pubsub
sender), version and schema, then freshness (not expired, not from the future,
lifetime at most MAX_AD_TTL_S). `decode_ad` is the part that does not depend on the
clock (so its result can be cached by the ad's digest: net/ad_intake.py) and
`check_fresh` the part that does. The per-peer rate is the view's job (net/view.py).
"""

from __future__ import annotations

import dataclasses
import math
import time

from libp2p.crypto.keys import KeyPair

from ..errors import PeerMisbehaved
from ..hardware import Hardware
from .reachability import REACHABILITIES, UNKNOWN
from .records import ALLOWED_DTYPES, FORMAT_LABEL, MAX_ADDRS, MAX_BLOCKS, MODEL_NAME, RUNTIME_BUILD
from .signed import addrs_field, field, open_sealed, seal, signer_of

AD_VERSION = 1
AD_PERIOD_S = 5.0
MIN_AD_PERIOD_S, MAX_AD_PERIOD_S = 1.0, 20.0  # the configured (base) period
MAX_STRETCHED_PERIOD_S = 600.0  # the period as stretched by a crowded topic (net/ad_intake.ad_period; 60 s before revision 23)
MAX_AD_TTL_S = 3 * MAX_STRETCHED_PERIOD_S  # revision 23: 1,800 s (180 s in revision 22, 60 s before)
AD_TTL_S = 3 * AD_PERIOD_S  # three missed periods and the peer is gone


def ad_ttl(period_s: float) -> float:
    return min(3 * period_s, MAX_AD_TTL_S)


MAX_CLOCK_SKEW_S = 30.0
MAX_AD_BYTES = 4096
MAX_SERVING = 8
SERVING_STATES = ("loading", "serving", "paused")  # paused: open sessions go on, no new ones
MAX_TOKENS = 1 << 31


@dataclasses.dataclass(frozen=True)
class Serving:
    """One span a node serves (or is loading) and how much room it has left."""

    model_id: str
    start: int
    end: int
    dtype: str
    free_tokens: int  # KV budget not yet promised to sessions
    load: float  # share of the last seconds its compute was busy, 0..1
    block_rate: float  # measured single-token steps per second through ONE block; 0 if unknown
    state: str = "serving"
    # Encrypted layer-steps per second it offers for private sessions (protocol.md,
    # /compushare/private); 0: it serves no private sessions.
    private_rate: float = 0.0
    fmt: str = ""  # the model's weight format label ("fp32", "q4/g64"; model/formats.py); "" = unsaid
    name: str = ""  # the name the server knows the model by ("smollm2-135m@q4"); "" = none
    # What computes the span and its build ("ggml/0.25.3:1f2e3d4c", "torch/2.13.0");
    # "" = unsaid (nodes before revision 26: torch). Answers of one build are bit-equal.
    runtime: str = ""

    def step_s(self, blocks: int) -> float | None:
        """Expected compute time of one decode step through `blocks` of its blocks."""
        return blocks / self.block_rate if self.block_rate > 0 else None

    def to_wire(self) -> dict:
        return {"model": self.model_id, "start": self.start, "end": self.end, "dtype": self.dtype,
                "free": self.free_tokens, "load": self.load, "rate": self.block_rate, "state": self.state,
                "priv": self.private_rate} | ({"fmt": self.fmt} if self.fmt else {}) | (
                    {"name": self.name} if self.name else {}) | ({"rt": self.runtime} if self.runtime else {})


@dataclasses.dataclass(frozen=True)
class CapabilityAd:
    peer_id: str
    addrs: tuple[str, ...]
    hardware: Hardware
    serving: tuple[Serving, ...]
    version: str  # software version
    seq: int  # strictly increasing per peer (ns since the epoch at signing)
    sent: float  # unix seconds
    expires: float  # unix seconds
    raw: bytes = b""  # the signed bytes, so views can be relayed and re-checked
    # Whether its own AutoNAT found it dialable (net/reachability), and whether it
    # relays for NAT'd peers (only a public node does): NAT'd nodes pick relays here.
    reach: str = UNKNOWN
    relay: bool = False

    def is_live(self, now: float) -> bool:
        return now < self.expires

    def serving_of(self, model_id: str) -> list[Serving]:
        return [s for s in self.serving if s.model_id == model_id]

    def _body(self) -> dict:
        return {
            "v": AD_VERSION,
            "peer": self.peer_id,
            "addrs": list(self.addrs),
            "hw": self.hardware.to_wire(),
            "serves": [s.to_wire() for s in self.serving],
            "sw": self.version,
            "seq": self.seq,
            "sent": self.sent,
            "expires": self.expires,
            "net": {"reach": self.reach, "relay": self.relay},
        }

    def sign(self, key_pair: KeyPair) -> bytes:
        return seal(self._body(), key_pair)


def make_ad(key_pair: KeyPair, peer_id: str, addrs: list[str], hardware: Hardware,
            serving: list[Serving], version: str, *, now: float | None = None,
            ttl_s: float = AD_TTL_S, seq: int | None = None, reach: str = UNKNOWN,
            relay: bool = False) -> CapabilityAd:
    """Build, sign and return an ad (its `raw` holds the signed bytes). Publishers
    pass `seq` above their last one, so a clock stepping back cannot stall them."""
    now = time.time() if now is None else now
    ad = CapabilityAd(peer_id, tuple(addrs[:MAX_ADDRS]), hardware, tuple(serving), version,
                      seq=time.time_ns() if seq is None else seq, sent=now, expires=now + ttl_s,
                      reach=reach, relay=relay)
    return dataclasses.replace(ad, raw=ad.sign(key_pair))


def _get(body: dict, name: str, kind: type | tuple[type, ...]):
    return field(body, name, kind, "ad")


def _finite(value: float, name: str, low: float = 0.0, high: float = math.inf) -> float:
    value = float(value)
    if not (math.isfinite(value) and low <= value <= high):
        raise PeerMisbehaved(f"ad field {name!r} out of range")
    return value


def _serving(obj: object) -> Serving:
    keys = {"model", "start", "end", "dtype", "free", "load", "rate", "state"}
    if not isinstance(obj, dict) or not keys <= set(obj) or set(obj) - keys - {"priv", "fmt", "name", "rt"}:
        raise PeerMisbehaved("ad 'serves' entry must have exactly model, start, end, dtype, free, load, rate, state "
                             "and optionally priv, fmt, name, rt")
    serving = Serving(
        model_id=_get(obj, "model", str),
        start=_get(obj, "start", int),
        end=_get(obj, "end", int),
        dtype=_get(obj, "dtype", str),
        free_tokens=_get(obj, "free", int),
        load=_finite(_get(obj, "load", (int, float)), "load", 0.0, 1.0),
        block_rate=_finite(_get(obj, "rate", (int, float)), "rate", 0.0, 1e9),
        state=_get(obj, "state", str),
        private_rate=_finite(_get(obj, "priv", (int, float)), "priv", 0.0, 1e9) if "priv" in obj else 0.0,
        fmt=_get(obj, "fmt", str) if "fmt" in obj else "",
        name=_get(obj, "name", str) if "name" in obj else "",
        runtime=_get(obj, "rt", str) if "rt" in obj else "",
    )
    if serving.fmt and not FORMAT_LABEL.fullmatch(serving.fmt):
        raise PeerMisbehaved(f"ad weight format {serving.fmt[:20]!r} is not a format label")
    if "rt" in obj and not RUNTIME_BUILD.fullmatch(serving.runtime):
        raise PeerMisbehaved("ad runtime must be 1-64 characters of letters, digits and ._:/+-")
    if serving.name and not MODEL_NAME.fullmatch(serving.name):
        raise PeerMisbehaved("ad model name must be 1-64 characters of letters, digits and ._@/-")
    if not (len(serving.model_id) == 64 and all(c in "0123456789abcdef" for c in serving.model_id)):
        raise PeerMisbehaved("ad model id must be 64 lowercase hex digits")
    if not (0 <= serving.start < serving.end <= MAX_BLOCKS):
        raise PeerMisbehaved(f"ad span {serving.start}:{serving.end} is invalid")
    if serving.dtype not in ALLOWED_DTYPES or serving.state not in SERVING_STATES:
        raise PeerMisbehaved("ad dtype or state not allowed")
    if not (0 <= serving.free_tokens < MAX_TOKENS):
        raise PeerMisbehaved("ad free tokens out of range")
    return serving


def _net(obj: object) -> tuple[str, bool]:
    if not isinstance(obj, dict) or set(obj) != {"reach", "relay"}:
        raise PeerMisbehaved("ad 'net' must have exactly reach and relay")
    if obj["reach"] not in REACHABILITIES or not isinstance(obj["relay"], bool):
        raise PeerMisbehaved("ad 'net' reach or relay malformed")
    return obj["reach"], obj["relay"]


def parse_ad(value: bytes, *, sender: str | None, now: float | None = None) -> CapabilityAd:
    """Check an ad (signature → schema → freshness) and return it, or raise PeerMisbehaved.

    `sender` is the peer the message came from (the pubsub originator, already
    checked against its own signature); None only when re-checking a relayed view,
    where the signature against the ad's own peer id is the whole proof.
    """
    ad = decode_ad(value, sender=sender)
    check_fresh(ad, time.time() if now is None else now)
    return ad


def decode_ad(value: bytes, *, sender: str | None) -> CapabilityAd:
    """Signature and schema: what does not depend on the clock (parse_ad's first part)."""
    if not isinstance(value, bytes | bytearray):
        raise PeerMisbehaved("an ad must be bytes")
    value = bytes(value)
    claimed = sender
    if claimed is None:
        claimed = signer_of(value)
        if claimed is None:
            raise PeerMisbehaved("malformed ad: no signer")
    body = open_sealed(value, claimed, max_bytes=MAX_AD_BYTES, what="ad")
    if body.get("v") != AD_VERSION:
        raise PeerMisbehaved("ad of an unknown version")
    fields = {"v", "peer", "addrs", "hw", "serves", "sw", "seq", "sent", "expires"}
    if set(body) not in (fields, fields | {"net"}):
        raise PeerMisbehaved("ad fields are not exactly those of version 1")
    reach, relay = _net(body.get("net", {"reach": UNKNOWN, "relay": False}))
    addrs = addrs_field(body, "ad", max_addrs=MAX_ADDRS)
    serves = _get(body, "serves", list)
    if len(serves) > MAX_SERVING:
        raise PeerMisbehaved(f"ad lists more than {MAX_SERVING} spans")
    try:
        hardware = Hardware.from_wire(body.get("hw"))
    except ValueError as exc:
        raise PeerMisbehaved(f"ad hardware malformed: {exc}") from None
    version = _get(body, "sw", str)
    if len(version) > 32:
        raise PeerMisbehaved("ad software version too long")
    ad = CapabilityAd(
        peer_id=_get(body, "peer", str),
        addrs=addrs,
        hardware=hardware,
        serving=tuple(_serving(s) for s in serves),
        version=version,
        seq=_get(body, "seq", int),
        sent=_finite(_get(body, "sent", (int, float)), "sent"),
        expires=_finite(_get(body, "expires", (int, float)), "expires"),
        raw=value,
        reach=reach,
        relay=relay,
    )
    if ad.peer_id != claimed:
        raise PeerMisbehaved(f"ad names peer {ad.peer_id} but was signed by {claimed}")
    if not (ad.sent < ad.expires <= ad.sent + MAX_AD_TTL_S):
        raise PeerMisbehaved(f"ad lifetime must be within (0, {MAX_AD_TTL_S:.0f}] s")
    return ad


def check_fresh(ad: CapabilityAd, now: float) -> None:
    """Freshness: not from the future, not expired (parse_ad's second part)."""
    if ad.sent > now + MAX_CLOCK_SKEW_S:
        raise PeerMisbehaved("ad sent in the future")
    if not ad.is_live(now):
        raise PeerMisbehaved("ad has expired")
