"""Signed private products and private failure reports. Pure, no I/O.

A provider signs every `projected` reply it sends (/compushare/private):

    ["compushare/private-proof/v1", model, params, layout, keys_digest, layer, group,
     tokens, input, output]

"with the CKKS parameter set `params`, slot layout `layout` and the Galois keys whose
digest is `keys_digest` (hex), product `group` of layer `layer` of model M, given the
request's `tokens`-token input ciphertexts with digest `input`, gives the output
ciphertexts with digest `output`". Both digests are over ciphertexts as they travel
(SEAL's serialisation), each ciphertext by its SHA-256, in order:

    input  = SHA-256(h(ct_1) || ... || h(ct_n))                         the request's
    output = SHA-256(n_1 || h(ct_1,1) .. h(ct_1,n_1) || n_2 || ...)     the reply's, per group
                                                                        (n_g: 4 bytes big-endian)

A product is deterministic integer arithmetic (products by plaintexts every provider
encodes alike from the same weights, rotations with the consumer's keys, a rescale,
sums): two honest providers answer one request with the very same bytes. So two
claims of one statement up to `output`, by two providers, with different outputs,
prove that one of the two did not compute what it signed: a report anyone can check
without the ciphertexts, the keys or the weights. It cannot say which one (only the
consumer, decrypting, can compare values; the report does not carry its verdict),
nor how far apart the two answers are.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import msgpack

from ..errors import PeerMisbehaved
from .fields import (DIGEST_BYTES, HEX64, PeerSigned, WireReport, check_peer, exact_map, is_signature, malformed,
                     report_body, report_wire, typed)

PRIVATE_DOMAIN = "compushare/private-proof/v1"
PRIVATE_REPORT_FORMAT = "compushare/private-failure-report/v1"
LAYOUT = "2"  # the slot layout of a product (protocol.md, "Layout of a product"; "2" since revision 24)
MAX_PRIVATE_REPORT_BYTES = 8192
_TEXT = {"model": 128, "params": 64, "layout": 16, "group": 16}  # the most characters of each string field


def input_digest(cts: Sequence[bytes]) -> bytes:
    """The digest of a request's input ciphertexts."""
    return hashlib.sha256(b"".join(hashlib.sha256(ct).digest() for ct in cts)).digest()


def output_digest(outs: Sequence[Sequence[bytes]]) -> bytes:
    """The digest of a reply's output ciphertexts (per group of the plan, its list)."""
    h = hashlib.sha256()
    for per_token in outs:
        h.update(len(per_token).to_bytes(4, "big"))
        for ct in per_token:
            h.update(hashlib.sha256(ct).digest())
    return h.digest()


@dataclasses.dataclass(frozen=True)
class PrivateStatement(PeerSigned):
    """What a provider signs for one `projected` reply (see the module docstring)."""

    model_id: str
    params: str
    layout: str
    keys_digest: str  # 64 lowercase hex, as `open` names it
    layer: int
    group: str
    tokens: int
    input_digest: bytes
    output_digest: bytes

    @classmethod
    def of(cls, model_id: str, params: str, keys_digest: str, layer: int, group: str, tokens: int,
           cts: Sequence[bytes], outs: Sequence[Sequence[bytes]], *, layout: str = LAYOUT) -> PrivateStatement:
        """The statement of a request's `cts` and its reply's `outs`."""
        return cls(model_id, params, layout, keys_digest, layer, group, tokens, input_digest(cts),
                   output_digest(outs))

    def encode(self) -> bytes:
        return msgpack.packb([PRIVATE_DOMAIN, self.model_id, self.params, self.layout, self.keys_digest, self.layer,
                              self.group, self.tokens, self.input_digest, self.output_digest], use_bin_type=True)

    def claim(self, peer_id: str, signature: object) -> PrivateClaim:
        """`peer_id`'s claim of this statement; PeerMisbehaved unless `signature` is its."""
        if not is_signature(signature):
            raise PeerMisbehaved("a projected reply without a signature")
        if not self.verify(peer_id, signature):
            raise PeerMisbehaved(f"the projected reply is not signed by {peer_id}")
        return PrivateClaim(peer_id, self.output_digest, signature)


@dataclasses.dataclass(frozen=True)
class PrivateClaim:
    """One provider's signed answer, as a report carries it: its output's digest."""

    peer_id: str
    output_digest: bytes
    signature: bytes

    def to_wire(self) -> dict:
        return {"peer": self.peer_id, "output_digest": self.output_digest, "sig": self.signature}


@dataclasses.dataclass(frozen=True)
class PrivateFailureReport(WireReport):
    """Two providers' signed, different answers to the same encrypted request.

    `accused` is the one the reporter found wrong (by decrypting, with a third
    opinion where there was one); the report itself proves only that they differ.
    """

    model_id: str
    params: str
    layout: str
    keys_digest: str
    layer: int
    group: str
    tokens: int
    input_digest: bytes
    accused: PrivateClaim
    witness: PrivateClaim

    @classmethod
    def of(cls, statement: PrivateStatement, accused: PrivateClaim, witness: PrivateClaim) -> PrivateFailureReport:
        """The report of two claims of `statement` (its output digest aside)."""
        s = statement
        return cls(s.model_id, s.params, s.layout, s.keys_digest, s.layer, s.group, s.tokens, s.input_digest,
                   accused, witness)

    def statement(self, claim: PrivateClaim) -> PrivateStatement:
        """What `claim`'s provider must have signed."""
        return PrivateStatement(self.model_id, self.params, self.layout, self.keys_digest, self.layer, self.group,
                                self.tokens, self.input_digest, claim.output_digest)

    def check(self) -> None:
        """Raise PeerMisbehaved unless both claims are signed and really differ."""
        if self.accused.peer_id == self.witness.peer_id:
            raise PeerMisbehaved("a failure report needs two different providers")
        if self.accused.output_digest == self.witness.output_digest:
            raise PeerMisbehaved("the two answers are the same: nothing to report")
        for claim in (self.accused, self.witness):
            if not self.statement(claim).verify(claim.peer_id, claim.signature):
                raise PeerMisbehaved(f"the claim of {claim.peer_id} is not signed by it")

    def to_wire(self) -> bytes:
        return report_wire(PRIVATE_REPORT_FORMAT, {
            "model": self.model_id, "params": self.params, "layout": self.layout, "keys_digest": self.keys_digest,
            "layer": self.layer, "group": self.group, "tokens": self.tokens, "input_digest": self.input_digest,
        }, self.accused.to_wire(), self.witness.to_wire())

    @classmethod
    def from_wire(cls, data: bytes) -> PrivateFailureReport:
        """Parse (not check: call check()) a report from anyone."""
        body, accused, witness = report_body(data, PRIVATE_REPORT_FORMAT, _REPORT_KEYS, _claim,
                                             max_bytes=MAX_PRIVATE_REPORT_BYTES, what="private failure report")
        with malformed("private failure report"):
            text = {name: _text(body[name], name) for name in _TEXT}
            report = cls(text["model"], text["params"], text["layout"], typed(body["keys_digest"], str),
                         typed(body["layer"], int), text["group"], typed(body["tokens"], int),
                         typed(body["input_digest"], bytes), accused, witness)
        if not (HEX64.fullmatch(report.keys_digest) and 0 <= report.layer <= 1 << 16
                and 1 <= report.tokens <= 1 << 16 and len(report.input_digest) == DIGEST_BYTES):
            raise PeerMisbehaved("private failure report fields out of range")
        return report


_REPORT_KEYS = {"format", "model", "params", "layout", "keys_digest", "layer", "group", "tokens", "input_digest",
                "accused", "witness"}
_CLAIM_KEYS = {"peer", "output_digest", "sig"}


def _claim(value: object, name: str) -> PrivateClaim:
    body = exact_map(value, _CLAIM_KEYS, name)
    claim = PrivateClaim(typed(body["peer"], str), typed(body["output_digest"], bytes), typed(body["sig"], bytes))
    check_peer(claim.peer_id)
    if len(claim.output_digest) != DIGEST_BYTES or not is_signature(claim.signature):
        raise ValueError(f"{name} fields out of range")
    return claim


def _text(value: object, name: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= _TEXT[name]:
        raise ValueError(f"{name} must be 1..{_TEXT[name]} characters")
    return value

