"""Signed DiLoCo contributions and DiLoCo failure reports. Pure, no I/O.

In round `round` of DiLoCo run `run`, a participant trains from the outer weights
whose digest is `base` and sends part `index` (of `parts`) of its int8-quantized
pseudo-gradient to member `index` of the all-reduce group whose digest is `group`.
It signs every part it sends:

    ["compushare/diloco-contribution/v1", run, round, base, peer, group, index,
     parts, tokens, part]

"I, `peer`, trained `tokens` tokens in round `round` of run `run` from the outer
weights `base`, and part `index` of `parts` of my pseudo-gradient, for the group
`group`, is the part whose digest is `part`" (part_digest: over the int8 values then
the per-chunk fp32 scales, as they travel).

Minibatches derive from public seeds, so any peer can re-run a participant's round.
A checker that does, and finds the part it received more than TOLERANCE away from
its own recomputation, signs what it computed:

    ["compushare/diloco-recomputation/v1", contribution, peer, part]

"I, `peer`, recomputed the contribution whose digest is `contribution`
(SHA-256 of its encoding above) and got the part whose digest is `part`". Its own
domain: a witness's recomputation must never read as a contribution it sent. The
two signatures with both parts' bytes make a DilocoFailureReport anyone can check
without re-running the round. Like the other reports, it proves that two peers
disagree beyond the tolerance, not which one lied; karma counts one per witness.

A part's format (diloco/quant.py writes it with torch): `q`, n int8 values; `scales`,
one little-endian fp32 scale per CHUNK values (the last chunk may be shorter);
value i = q[i] × scales[i // CHUNK].
"""

from __future__ import annotations

import dataclasses
import hashlib

import msgpack
import numpy as np
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID

from ..errors import PeerMisbehaved
from .fields import (DIGEST_BYTES, HEX64, MAX_SIG_BYTES, SelfSigned, WireReport, check_peer, exact_map, is_signature,
                     malformed, report_body, report_wire, typed)

CONTRIBUTION_DOMAIN = "compushare/diloco-contribution/v1"
RECOMPUTATION_DOMAIN = "compushare/diloco-recomputation/v1"
DILOCO_REPORT_FORMAT = "compushare/diloco-failure-report/v1"
# The relative L2 error, ‖accused − witness‖₂ / ‖witness‖₂ over the dequantized parts,
# beyond which the two cannot both be honest. Int8 rounding with one absmax scale per
# 256 values costs 0.7% of a part's norm for Gaussian values, 1.7% for heavy-tailed ones
# (Student t, 3 degrees of freedom), and two parts 1e-3 apart before rounding end 0.5%
# apart after it (numpy, 2^18 values). 1e-3 stands for another CPU's kernels over a
# round of H fp32 steps from the same seeds and data: assumed, not yet measured on the
# trainer. 0.1 is several times both together, and still catches what a free
# rider or a poisoner sends: zeros (error 1), noise or a stale or another peer's
# pseudo-gradient (1.4), or the true one scaled by under 0.9.
TOLERANCE = 0.1
CHUNK = 256  # values per fp32 scale
MAX_PART_ELEMENTS = 1 << 20
MAX_PARTS = 1 << 12  # members of one all-reduce group at most
# Two parts of at most MAX_PART_ELEMENTS (1 byte per value and 4 per CHUNK values)
# and 64 KiB for everything else: 2.1 MB, under fields.MAX_REPORT_BYTES (4 MiB).
MAX_DILOCO_REPORT_BYTES = 2 * (MAX_PART_ELEMENTS + 4 * (MAX_PART_ELEMENTS // CHUNK)) + (64 << 10)
_MAX_INT = 1 << 63


def scales_bytes(elements: int) -> int:
    """How many bytes of scales a part of `elements` values carries."""
    return 4 * -(-elements // CHUNK)


def check_part(q: bytes, scales: bytes) -> None:
    """PeerMisbehaved unless `q` and `scales` have a part's sizes."""
    if not isinstance(q, bytes | bytearray) or not 0 < len(q) <= MAX_PART_ELEMENTS:
        raise PeerMisbehaved(f"a part has 1..{MAX_PART_ELEMENTS} int8 values")
    if not isinstance(scales, bytes | bytearray) or len(scales) != scales_bytes(len(q)):
        raise PeerMisbehaved(f"a part of {len(q)} values has {scales_bytes(len(q))} bytes of scales")


def part_digest(q: bytes, scales: bytes) -> bytes:
    """The digest a contribution signs: SHA-256(q || scales), as they travel."""
    return hashlib.sha256(bytes(q) + bytes(scales)).digest()


def dequantize(q: bytes, scales: bytes) -> np.ndarray:
    """A part's values, float64 (check_part first)."""
    values = np.frombuffer(q, dtype=np.int8).astype(np.float64)
    return values * np.repeat(np.frombuffer(scales, dtype="<f4").astype(np.float64), CHUNK)[:values.size]


def part_error(q: bytes, scales: bytes, ref_q: bytes, ref_scales: bytes) -> float:
    """‖part − reference‖₂ / ‖reference‖₂ of two checked parts (infinite for other sizes
    or a non-finite part; PeerMisbehaved for a non-finite reference: nothing to compare to)."""
    a, b = dequantize(q, scales), dequantize(ref_q, ref_scales)
    if not np.isfinite(b).all():
        raise PeerMisbehaved("the recomputed part is not finite")
    if a.shape != b.shape or not np.isfinite(a).all():
        return float("inf")
    with np.errstate(over="ignore", invalid="ignore"):
        error = float(np.linalg.norm(a - b) / max(float(np.linalg.norm(b)), 1e-30))
    return error if np.isfinite(error) else float("inf")


@dataclasses.dataclass(frozen=True)
class DilocoClaim:
    """One peer's signed part, as a report carries it: the part's bytes and the signature."""

    peer_id: str
    q: bytes
    scales: bytes
    signature: bytes

    @property
    def part(self) -> bytes:
        return part_digest(self.q, self.scales)

    def to_wire(self) -> dict:
        return {"peer": self.peer_id, "q": self.q, "scales": self.scales, "sig": self.signature}


@dataclasses.dataclass(frozen=True)
class Contribution(SelfSigned):
    """What a participant signs for one part it sends (see the module docstring)."""

    run: str  # 64 lowercase hex
    round: int
    base: bytes  # SHA-256 of the outer weights' flat fp32 bytes
    peer: str  # the contributor
    group: bytes  # the all-reduce attempt's digest (diloco/group.py's group_digest)
    index: int
    parts: int
    tokens: int
    part: bytes  # part_digest of what it sends

    @classmethod
    def of(cls, run: str, round: int, base: bytes, peer: str, group: bytes, index: int, parts: int, tokens: int,
           q: bytes, scales: bytes) -> Contribution:
        """The statement of part `index` whose bytes are `q` and `scales`."""
        return cls(run, round, base, peer, group, index, parts, tokens, part_digest(q, scales))

    def encode(self) -> bytes:
        return msgpack.packb([CONTRIBUTION_DOMAIN, self.run, self.round, self.base, self.peer, self.group,
                              self.index, self.parts, self.tokens, self.part], use_bin_type=True)

    @property
    def digest(self) -> bytes:
        """What a recomputation names: SHA-256 of the encoding."""
        return hashlib.sha256(self.encode()).digest()

    def claim(self, signature: object, q: bytes, scales: bytes) -> DilocoClaim:
        """The received part as a claim; PeerMisbehaved unless `q` and `scales` are a part,
        hash to `part`, and `signature` is `peer`'s of this statement."""
        check_part(q, scales)
        if part_digest(q, scales) != self.part:
            raise PeerMisbehaved("the part's bytes are not the ones its contribution signs")
        if not is_signature(signature) or not self.verify(signature):
            raise PeerMisbehaved(f"the contribution is not signed by {self.peer}")
        return DilocoClaim(self.peer, bytes(q), bytes(scales), signature)

    def to_wire(self) -> dict:
        return {"run": self.run, "round": self.round, "base": self.base, "peer": self.peer, "group": self.group,
                "index": self.index, "parts": self.parts, "tokens": self.tokens, "part": self.part}

    @classmethod
    def from_wire(cls, body: object) -> Contribution:
        """Parse (not verify) a contribution as to_wire() gives it, from anyone."""
        with malformed("DiLoCo contribution"):
            body = exact_map(body, _CONTRIBUTION_KEYS, "a contribution")
            contribution = cls(typed(body["run"], str), typed(body["round"], int), typed(body["base"], bytes),
                               typed(body["peer"], str), typed(body["group"], bytes), typed(body["index"], int),
                               typed(body["parts"], int), typed(body["tokens"], int), typed(body["part"], bytes))
            _check_fields(contribution.run, contribution.round, contribution.base, contribution.group,
                          contribution.index, contribution.parts, contribution.tokens)
            check_peer(contribution.peer)
            if len(contribution.part) != DIGEST_BYTES:
                raise ValueError("a part digest is 32 bytes")
        return contribution


@dataclasses.dataclass(frozen=True)
class Recomputation(SelfSigned):
    """What a witness signs: "I recomputed that contribution and got this part"."""

    contribution: bytes  # Contribution.digest of the accused's statement
    peer: str  # the witness
    part: bytes  # part_digest of its recomputed part

    def encode(self) -> bytes:
        return msgpack.packb([RECOMPUTATION_DOMAIN, self.contribution, self.peer, self.part], use_bin_type=True)


@dataclasses.dataclass(frozen=True)
class DilocoFailureReport(WireReport):
    """A signed contribution and a witness's signed recomputation of it, with both parts,
    more than TOLERANCE apart. The fields are the contribution's but `peer` and `part`
    (the accused claim's peer and its bytes' digest)."""

    run: str
    round: int
    base: bytes
    group: bytes
    index: int
    parts: int
    tokens: int
    accused: DilocoClaim
    witness: DilocoClaim

    @classmethod
    def of(cls, contribution: Contribution, accused: DilocoClaim, witness: DilocoClaim) -> DilocoFailureReport:
        c = contribution
        return cls(c.run, c.round, c.base, c.group, c.index, c.parts, c.tokens, accused, witness)

    @classmethod
    def witnessed(cls, key_pair: KeyPair, contribution: Contribution, accused: DilocoClaim, q: bytes,
                  scales: bytes) -> DilocoFailureReport:
        """The report of the witness holding `key_pair`, whose recomputation of `contribution`
        (received as `accused`, from Contribution.claim) gave `q` and `scales`. Not checked."""
        peer = ID.from_pubkey(key_pair.public_key).to_base58()
        signature = Recomputation(contribution.digest, peer, part_digest(q, scales)).sign(key_pair)
        return cls.of(contribution, accused, DilocoClaim(peer, bytes(q), bytes(scales), signature))

    def contribution(self) -> Contribution:
        """What the accused must have signed."""
        return Contribution(self.run, self.round, self.base, self.accused.peer_id, self.group, self.index, self.parts,
                            self.tokens, self.accused.part)

    def recomputation(self) -> Recomputation:
        """What the witness must have signed."""
        return Recomputation(self.contribution().digest, self.witness.peer_id, self.witness.part)

    def error(self) -> float:
        return part_error(self.accused.q, self.accused.scales, self.witness.q, self.witness.scales)

    def check(self) -> None:
        """Raise PeerMisbehaved unless both are signed, of one part, and really disagree."""
        if self.accused.peer_id == self.witness.peer_id:
            raise PeerMisbehaved("a failure report needs two different peers")
        for claim in (self.accused, self.witness):
            check_part(claim.q, claim.scales)
        if len(self.accused.q) != len(self.witness.q):
            raise PeerMisbehaved("the two parts have different sizes: not one part of one round")
        if not self.contribution().verify(self.accused.signature):
            raise PeerMisbehaved(f"the contribution of {self.accused.peer_id} is not signed by it")
        if not self.recomputation().verify(self.witness.signature):
            raise PeerMisbehaved(f"the recomputation of {self.witness.peer_id} is not signed by it")
        if not self.error() > TOLERANCE:
            raise PeerMisbehaved("the two parts agree within the tolerance: nothing to report")

    def to_wire(self) -> bytes:
        return report_wire(DILOCO_REPORT_FORMAT, {
            "run": self.run, "round": self.round, "base": self.base, "group": self.group, "index": self.index,
            "parts": self.parts, "tokens": self.tokens,
        }, self.accused.to_wire(), self.witness.to_wire())

    @classmethod
    def from_wire(cls, data: bytes) -> DilocoFailureReport:
        """Parse (not check: call check()) a report from anyone."""
        body, accused, witness = report_body(data, DILOCO_REPORT_FORMAT, _REPORT_KEYS, _claim,
                                             max_bytes=MAX_DILOCO_REPORT_BYTES, what="DiLoCo failure report")
        with malformed("DiLoCo failure report"):
            report = cls(typed(body["run"], str), typed(body["round"], int), typed(body["base"], bytes),
                         typed(body["group"], bytes), typed(body["index"], int), typed(body["parts"], int),
                         typed(body["tokens"], int), accused, witness)
            _check_fields(report.run, report.round, report.base, report.group, report.index, report.parts,
                          report.tokens)
        return report


_CONTRIBUTION_KEYS = {"run", "round", "base", "peer", "group", "index", "parts", "tokens", "part"}
_REPORT_KEYS = {"format", "run", "round", "base", "group", "index", "parts", "tokens", "accused", "witness"}
_CLAIM_KEYS = {"peer", "q", "scales", "sig"}


def _check_fields(run: str, round: int, base: bytes, group: bytes, index: int, parts: int, tokens: int) -> None:
    if not HEX64.fullmatch(run):
        raise ValueError("a run id is 64 lowercase hex digits")
    if len(base) != DIGEST_BYTES or len(group) != DIGEST_BYTES:
        raise ValueError("base and group are 32-byte digests")
    if not (0 <= round < _MAX_INT and 1 <= parts <= MAX_PARTS and 0 <= index < parts and 0 <= tokens < _MAX_INT):
        raise ValueError("round, index, parts or tokens out of range")


def _claim(value: object, name: str) -> DilocoClaim:
    body = exact_map(value, _CLAIM_KEYS, name)
    claim = DilocoClaim(typed(body["peer"], str), typed(body["q"], bytes), typed(body["scales"], bytes),
                        typed(body["sig"], bytes))
    check_peer(claim.peer_id)
    check_part(claim.q, claim.scales)
    if not is_signature(claim.signature):
        raise ValueError(f"{name}'s signature is 1..{MAX_SIG_BYTES} bytes")
    return claim
