"""What every kind of signed evidence shares: the sizes of digests, signatures, peer ids
and reports, signing a statement, and parsing a report's fields from anyone (each
kind's own checks are in its module). Pure, no I/O."""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections.abc import Callable, Iterator
from typing import TypeGuard, TypeVar

import msgpack
from libp2p.crypto.keys import KeyPair

from ..errors import PeerMisbehaved
from ..net.signed import signed_by

DIGEST_BYTES = 32
MAX_SIG_BYTES = 1024  # an Ed25519 signature is 64 bytes; RSA's up to 512
MAX_PEER_CHARS = 128
MAX_REPORT_BYTES = 4 * 1024 * 1024  # a report of any kind (parse_report); a kind may keep its own, smaller
HEX64 = re.compile(r"[0-9a-f]{64}")
Claim = TypeVar("Claim")


class Signable:
    """A statement a peer signs: its msgpack encoding, which starts with its kind's
    domain string, so that no statement of one kind reads as one of another."""

    def encode(self) -> bytes:
        raise NotImplementedError

    def sign(self, key_pair: KeyPair) -> bytes:
        return key_pair.private_key.sign(self.encode())


class PeerSigned(Signable):
    """A statement that does not name its signer: the verifier says whose it must be."""

    def verify(self, peer_id: str, signature: bytes) -> bool:
        return signed_by(peer_id, self.encode(), signature)


class SelfSigned(Signable):
    """A statement that names its signer, by peer id, in its field `peer`."""

    peer: str

    def verify(self, signature: bytes) -> bool:
        """Signed by `peer` (its public key is in its peer id)."""
        return signed_by(self.peer, self.encode(), signature)


def is_signature(value: object) -> TypeGuard[bytes]:
    """Whether `value` can be a signature: 1..MAX_SIG_BYTES bytes (not whose it is)."""
    return isinstance(value, bytes) and 0 < len(value) <= MAX_SIG_BYTES


def check_peer(peer: str) -> None:
    if not 0 < len(peer) <= MAX_PEER_CHARS:
        raise ValueError(f"a peer id is 1..{MAX_PEER_CHARS} characters")


def typed(value, kind):
    """`value` if it is a `kind` (a bool never passes for an int); ValueError otherwise."""
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"{value!r:.40} has the wrong type")
    return value


def exact_map(value: object, keys: set[str], name: str) -> dict:
    """`value` if it is a map of exactly `keys`; ValueError otherwise."""
    if not isinstance(value, dict) or set(value) != keys:
        raise ValueError(f"{name} is not a map of exactly {sorted(keys)}")
    return value


@contextlib.contextmanager
def malformed(what: str) -> Iterator[None]:
    """Any error in the block as PeerMisbehaved: fields from anyone that are not what
    they must be are the sender's fault, whatever check they fail."""
    try:
        yield
    except Exception as exc:
        raise PeerMisbehaved(f"malformed {what}: {exc}") from None


class WireReport:
    """A failure report as it travels (report_wire), named by its bytes' digest."""

    def to_wire(self) -> bytes:
        raise NotImplementedError

    @property
    def digest(self) -> str:
        """Hex SHA-256 of the wire bytes: the name karma stores and compares it by."""
        return hashlib.sha256(self.to_wire()).hexdigest()


def report_wire(report_format: str, fields: dict, accused: dict, witness: dict) -> bytes:
    """A report's bytes: one msgpack map of its "format", its kind's `fields`, then the
    two conflicting claims (keys in that order: the bytes are what karma names)."""
    return msgpack.packb({"format": report_format, **fields, "accused": accused, "witness": witness},
                         use_bin_type=True)


def report_body(data: object, report_format: str, keys: set[str], read_claim: Callable[[object, str], Claim], *,
                max_bytes: int, what: str) -> tuple[dict, Claim, Claim]:
    """A `report_format` report from anyone: the map of exactly `keys` that `data`, at most
    `max_bytes`, encodes (its other fields still to be typed), and its accused's and
    witness's claims as `read_claim` reads them. PeerMisbehaved otherwise."""
    if not isinstance(data, bytes | bytearray) or len(data) > max_bytes:
        raise PeerMisbehaved(f"a {what} is at most {max_bytes} bytes")
    with malformed(what):
        body = msgpack.unpackb(data, raw=False, strict_map_key=True)
        if not isinstance(body, dict) or body.get("format") != report_format:
            raise ValueError(f"not a {report_format}")
        if set(body) != keys:
            raise ValueError(f"fields {sorted(body)}")
        accused, witness = (read_claim(body[name], name) for name in ("accused", "witness"))
    return body, accused, witness
