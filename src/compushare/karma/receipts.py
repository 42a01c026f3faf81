"""Receipts: a consumer's signed statement that a server computed for it. Pure, no I/O.

The consumer signs what it observed of one session with one server (tokens run,
the compute time the server reported, capped by the wall time the consumer saw);
the server countersigns. Only a receipt carrying both signatures counts, and only
in the ledger of the server it names. A session yields one receipt per RECEIPT_STEPS
steps and one at its end, numbered by `seq`, so a crash loses little.

Wire: msgpack {"body": bin, "csig": bin, "ssig": bin}; the consumer signs
[CONSUMER_DOMAIN, body], the server [SERVER_DOMAIN, body, csig].
"""

from __future__ import annotations

import dataclasses
import hashlib
import math

import msgpack
from libp2p.crypto.keys import PrivateKey

from ..errors import PeerMisbehaved
from ..net.signed import field, signed_by

RECEIPT_VERSION = 1
CONSUMER_DOMAIN = "compushare/receipt/consumer/v1"
SERVER_DOMAIN = "compushare/receipt/server/v1"
MAX_RECEIPT_BYTES = 2048
SESSION_ID_BYTES = 16
RECEIPT_STEPS = 256  # a long session is receipted every this many steps
BODY_KEYS = frozenset({"v", "server", "consumer", "model", "start", "end", "session", "seq", "tokens", "compute_ms",
                       "wall_ms", "time"})
MAX_ID_CHARS = 128  # peer ids and model ids


@dataclasses.dataclass(frozen=True)
class Receipt:
    server: str  # peer ids
    consumer: str
    model_id: str
    start: int  # the span the session ran
    end: int
    session: bytes
    seq: int  # 0, 1, ... within the session: each covers the steps since the last
    tokens: int
    compute_ms: float  # the server's measure of its compute for those steps
    wall_ms: float  # what the consumer waited for those steps, round trips included
    time: float  # unix seconds, when the consumer signed

    def body(self) -> bytes:
        return msgpack.packb({
            "v": RECEIPT_VERSION, "server": self.server, "consumer": self.consumer, "model": self.model_id,
            "start": self.start, "end": self.end, "session": self.session, "seq": self.seq,
            "tokens": self.tokens, "compute_ms": self.compute_ms, "wall_ms": self.wall_ms, "time": self.time,
        }, use_bin_type=True)

    @property
    def slot(self) -> tuple[str, str, bytes, int]:
        """What a receipt may exist once for: a second one for the same slot is a replay."""
        return self.server, self.consumer, self.session, self.seq


def _consumer_statement(body: bytes) -> bytes:
    return msgpack.packb([CONSUMER_DOMAIN, body], use_bin_type=True)


def _server_statement(body: bytes, consumer_sig: bytes) -> bytes:
    return msgpack.packb([SERVER_DOMAIN, body, consumer_sig], use_bin_type=True)


def sign_receipt(receipt: Receipt, consumer_key: PrivateKey) -> bytes:
    """The consumer's half: a receipt without the server's signature yet."""
    body = receipt.body()
    return msgpack.packb({"body": body, "csig": consumer_key.sign(_consumer_statement(body)), "ssig": b""},
                         use_bin_type=True)


def countersign(wire: bytes, server_key: PrivateKey) -> bytes:
    """The server's half, added to a consumer-signed receipt (check it first)."""
    envelope = _envelope(wire)
    envelope["ssig"] = server_key.sign(_server_statement(envelope["body"], envelope["csig"]))
    return msgpack.packb(envelope, use_bin_type=True)


def receipt_id(wire: bytes) -> bytes:
    return hashlib.sha256(wire).digest()


def parse_receipt(wire: bytes, *, countersigned: bool = True) -> Receipt:
    """Check size, structure, the consumer's signature, then (unless only the
    consumer's half is expected) the server's; then the schema. Raise PeerMisbehaved."""
    envelope = _envelope(wire)
    body_bytes, csig, ssig = envelope["body"], envelope["csig"], envelope["ssig"]
    try:
        body = msgpack.unpackb(body_bytes, raw=False, strict_map_key=True)
    except Exception as exc:
        raise PeerMisbehaved(f"malformed receipt body: {exc}") from None
    if not isinstance(body, dict) or body.get("v") != RECEIPT_VERSION:
        raise PeerMisbehaved("receipt of an unknown version")
    if set(body) != BODY_KEYS:  # nothing unsigned-for rides along, and the size stays bounded
        raise PeerMisbehaved(f"receipt fields must be exactly {sorted(BODY_KEYS)}")
    what = "receipt"
    receipt = Receipt(
        server=field(body, "server", str, what), consumer=field(body, "consumer", str, what),
        model_id=field(body, "model", str, what), start=field(body, "start", int, what),
        end=field(body, "end", int, what), session=field(body, "session", bytes, what),
        seq=field(body, "seq", int, what), tokens=field(body, "tokens", int, what),
        compute_ms=float(field(body, "compute_ms", (int, float), what)),
        wall_ms=float(field(body, "wall_ms", (int, float), what)), time=float(field(body, "time", (int, float), what)),
    )
    if not signed_by(receipt.consumer, _consumer_statement(body_bytes), csig):
        raise PeerMisbehaved(f"receipt not signed by its consumer {receipt.consumer}")
    if countersigned and not signed_by(receipt.server, _server_statement(body_bytes, csig), ssig):
        raise PeerMisbehaved(f"receipt not countersigned by its server {receipt.server}")
    if not (0 <= receipt.start < receipt.end and receipt.seq >= 0 and receipt.tokens >= 1
            and len(receipt.session) == SESSION_ID_BYTES
            and all(len(x) <= MAX_ID_CHARS for x in (receipt.model_id, receipt.server, receipt.consumer))
            and all(math.isfinite(x) and x >= 0 for x in (receipt.compute_ms, receipt.wall_ms, receipt.time))):
        raise PeerMisbehaved("receipt fields out of range")
    return receipt


def _envelope(wire: bytes) -> dict:
    if not isinstance(wire, bytes | bytearray) or len(wire) > MAX_RECEIPT_BYTES:
        raise PeerMisbehaved(f"a receipt is at most {MAX_RECEIPT_BYTES} bytes")
    try:
        envelope = msgpack.unpackb(wire, raw=False, strict_map_key=True)
        if not isinstance(envelope, dict) or set(envelope) != {"body", "csig", "ssig"} \
                or not all(isinstance(v, bytes) for v in envelope.values()):
            raise ValueError("a receipt is a map of exactly body, csig, ssig (bytes)")
    except Exception as exc:
        raise PeerMisbehaved(f"malformed receipt: {exc}") from None
    return envelope


