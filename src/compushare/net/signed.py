"""Owner-signed envelopes, shared by DHT server records and gossip ads. Pure, no I/O.

Wire: msgpack {"body": <msgpack map as bytes>, "sig": <Ed25519 signature of body>}.
The signer is named by a peer id; an Ed25519 peer id embeds its public key, so
anyone can check an envelope without another look-up. Order of checks: size,
structure, signature, then the body is decoded (schema checks are the caller's).
"""

from __future__ import annotations

import msgpack
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID
from libp2p.records.validator import Validator

from ..errors import PeerMisbehaved


def seal(body: dict, key_pair: KeyPair) -> bytes:
    body_bytes = msgpack.packb(body, use_bin_type=True)
    signature = key_pair.private_key.sign(body_bytes)
    return msgpack.packb({"body": body_bytes, "sig": signature}, use_bin_type=True)


def open_sealed(value: bytes, signer: str, *, max_bytes: int, what: str) -> dict:
    """The body of `value` if `signer` signed it; raise PeerMisbehaved otherwise."""
    if not isinstance(value, bytes | bytearray):
        raise PeerMisbehaved(f"{what} must be bytes")
    if len(value) > max_bytes:
        raise PeerMisbehaved(f"{what} of {len(value)} bytes exceeds {max_bytes}")
    try:
        envelope = msgpack.unpackb(value, raw=False, strict_map_key=True)
        body_bytes, signature = envelope["body"], envelope["sig"]
        if not isinstance(body_bytes, bytes) or not isinstance(signature, bytes):
            raise TypeError("body and sig must be bytes")
        owner_key = ID.from_base58(signer).extract_public_key()
    except Exception as exc:
        raise PeerMisbehaved(f"malformed {what}: {exc}") from None
    if owner_key is None:
        raise PeerMisbehaved(f"{what}: the signer's peer id does not embed a public key")
    try:
        valid = owner_key.verify(body_bytes, signature)
    except Exception:
        valid = False
    if not valid:
        raise PeerMisbehaved(f"{what} signature does not match {signer}")
    try:
        body = msgpack.unpackb(body_bytes, raw=False, strict_map_key=True)
    except Exception as exc:
        raise PeerMisbehaved(f"malformed {what} body: {exc}") from None
    if not isinstance(body, dict):
        raise PeerMisbehaved(f"{what} body must be a map")
    return body


def signed_by(peer_id: str, message: bytes, signature: bytes) -> bool:
    """Whether `signature` over `message` is the key's that `peer_id` embeds (a malformed
    peer id or signature is simply not valid)."""
    try:
        key = ID.from_base58(peer_id).extract_public_key()
        return key is not None and bool(key.verify(message, signature))
    except Exception:
        return False


def signer_of(value: bytes) -> str | None:
    """The "peer" field a sealed body claims, unverified (to pick the key to check)."""
    try:
        envelope = msgpack.unpackb(value, raw=False, strict_map_key=True)
        body = msgpack.unpackb(envelope["body"], raw=False, strict_map_key=True)
        peer = body["peer"]
    except Exception:
        return None
    return peer if isinstance(peer, str) else None


def field(body: dict, name: str, kind: type | tuple[type, ...], what: str):
    """`body[name]` if it has type `kind` (a bool never passes for an int)."""
    value = body.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise PeerMisbehaved(f"{what} field {name!r} missing or of the wrong type")
    return value


def addrs_field(body: dict, what: str, *, max_addrs: int) -> tuple[str, ...]:
    addrs = field(body, "addrs", list, what)
    if len(addrs) > max_addrs or not all(isinstance(a, str) and len(a) < 256 for a in addrs):
        raise PeerMisbehaved(f"{what} addrs malformed")
    return tuple(addrs)


def newest_valid(values: list[bytes], parse) -> int:
    """DHT select(): the index of the value `parse` accepts (it raises PeerMisbehaved
    otherwise) with the highest `seq`; 0 if none is valid."""
    best, best_seq = 0, None
    for index, value in enumerate(values):
        try:
            seq = parse(value).seq
        except PeerMisbehaved:
            continue
        if best_seq is None or seq > best_seq:
            best, best_seq = index, seq
    return best


class SignedRecordValidator(Validator):
    """The DHT's validator of one namespace of owner-signed records with a seq:
    `parse(key, value)` checks signature, then schema, then freshness (raising
    PeerMisbehaved); `select(key, values)` picks the newest valid one."""

    def __init__(self, parse, select) -> None:
        self._parse, self._select = parse, select

    def validate(self, key: str, value: bytes) -> None:
        self._parse(key, value)

    def select(self, key: str, values: list[bytes]) -> int:
        return self._select(key, values)
