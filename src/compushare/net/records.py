"""Signed server records: what a provider tells the DHT it serves. Pure, no I/O.

Wire: a sealed envelope (net/signed.py) signed by the peer the key names.
The DHT key names the owner (`/csserver/<model_id>/<peer_id>`); an Ed25519 peer id
embeds its public key, so anyone can check the signature without another lookup.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time

from libp2p.crypto.keys import KeyPair

from .. import wire
from ..errors import PeerMisbehaved
from .signed import addrs_field, field, newest_valid, open_sealed, seal

RECORD_NAMESPACE = wire.SERVER_RECORDS
RECORD_VERSION = 1
MAX_RECORD_BYTES = 8 * 1024
MAX_ADDRS = 8
MAX_BLOCKS = 4096
ALLOWED_DTYPES = ("float32", "float16", "bfloat16")
# What records and ads may say of a model's weight format and name (model/formats.py, model/catalog.py).
FORMAT_LABEL = re.compile(r"fp32|bf16|int8|q4/g(32|64|128)|gguf")
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@/-]{0,63}")
RUNTIME_BUILD = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/+-]{0,63}")  # an ad's "rt": "ggml/0.25.3:1f2e3d4c"


def record_key(model_id: str, peer_id: str) -> str:
    return f"/{RECORD_NAMESPACE}/{model_id}/{peer_id}"


@dataclasses.dataclass(frozen=True)
class ServerRecord:
    peer_id: str
    model_id: str
    start: int
    end: int
    dtype: str
    addrs: tuple[str, ...]
    expires: float  # unix seconds; consumers ignore the record after this
    seq: int  # strictly increasing per owner; the DHT keeps the highest
    throughput: float = 0.0  # measured tokens/s of this span, 0 if unknown
    fmt: str = ""  # the model's weight format label (net/ads.FORMAT_LABEL); "" = unsaid (an older node)

    def covers(self, block: int) -> bool:
        return self.start <= block < self.end

    def is_live(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) < self.expires

    def _body(self) -> dict:
        return {
            "v": RECORD_VERSION,
            "peer": self.peer_id,
            "model": self.model_id,
            "start": self.start,
            "end": self.end,
            "dtype": self.dtype,
            "addrs": list(self.addrs),
            "expires": self.expires,
            "seq": self.seq,
            "tps": self.throughput,
        } | ({"fmt": self.fmt} if self.fmt else {})

    def sign(self, key_pair: KeyPair) -> bytes:
        return seal(self._body(), key_pair)


def _field(body: dict, name: str, kind: type | tuple[type, ...]):
    return field(body, name, kind, "server record")


def parse_record(key: str, value: bytes, *, now: float | None = None, allow_expired: bool = False) -> ServerRecord:
    """Check signature, then schema, then freshness; return the record or raise."""
    parts = key.split("/")
    if len(parts) != 4 or parts[0] != "" or parts[1] != RECORD_NAMESPACE:
        raise PeerMisbehaved(f"not a server record key: {key!r}")
    _, _, key_model, key_peer = parts
    body = open_sealed(value, key_peer, max_bytes=MAX_RECORD_BYTES, what="server record")
    if not isinstance(body, dict) or body.get("v") != RECORD_VERSION:
        raise PeerMisbehaved("server record of an unknown version")
    addrs = addrs_field(body, "server record", max_addrs=MAX_ADDRS)
    record = ServerRecord(
        peer_id=_field(body, "peer", str),
        model_id=_field(body, "model", str),
        start=_field(body, "start", int),
        end=_field(body, "end", int),
        dtype=_field(body, "dtype", str),
        addrs=addrs,
        expires=float(_field(body, "expires", (int, float))),
        seq=_field(body, "seq", int),
        throughput=float(_field(body, "tps", (int, float))),
        fmt=_field(body, "fmt", str) if "fmt" in body else "",
    )
    if record.peer_id != key_peer or record.model_id != key_model:
        raise PeerMisbehaved("server record body disagrees with its key")
    if not (0 <= record.start < record.end <= MAX_BLOCKS):
        raise PeerMisbehaved(f"server record span {record.start}:{record.end} is invalid")
    if not (math.isfinite(record.throughput) and record.throughput >= 0 and math.isfinite(record.expires)):
        raise PeerMisbehaved("server record throughput / expiry must be finite (throughput >= 0)")
    if record.fmt and not FORMAT_LABEL.fullmatch(record.fmt):
        raise PeerMisbehaved("server record weight format is not a format label")
    if record.dtype not in ALLOWED_DTYPES:
        raise PeerMisbehaved(f"server record dtype {record.dtype!r} not allowed")
    if not allow_expired and not record.is_live(now):
        raise PeerMisbehaved("server record has expired")
    return record


def newest_index(key: str, values: list[bytes]) -> int:
    """DHT select(): the valid record with the highest seq wins."""
    return newest_valid(values, lambda value: parse_record(key, value, allow_expired=True))
