"""Signed step outputs and failure reports. Pure, no I/O.

A server signs every step it answers: "for model M, blocks s:e, given the input
stream whose running digest is D (every hidden state this session sent to the span,
in position order), the output of positions p..p+n-1 has digest O". Two such claims
with the same (M, s, e, p, n, D) and outputs that differ beyond the tolerance prove
that one of the two servers computed wrongly: a failure report anyone can check.
The running digest covers the whole prefix, so a consumer cannot pair one server's
answer with another server's answer to a different history.
"""

from __future__ import annotations

import dataclasses
import hashlib

import msgpack
import numpy as np
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID

from .errors import PeerMisbehaved
from .net.dtypes import WIRE_NUMPY_DTYPES

STEP_DOMAIN = "compushare/step-proof/v1"
REPORT_FORMAT = "compushare/failure-report/v1"
DEFAULT_TOLERANCE = 1e-3  # relative L2 error; chunking alone gives ~1e-5 on SmolLM2
MAX_REPORT_BYTES = 4 * 1024 * 1024


class InputDigest:
    """Running SHA-256 over a session's input bytes, independent of how they were chunked."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()

    def update(self, data: bytes | memoryview) -> None:
        self._hash.update(data)

    def digest(self) -> bytes:
        return self._hash.copy().digest()


def statement(model_id: str, start: int, end: int, position: int, tokens: int, input_digest: bytes,
              output_digest: bytes) -> bytes:
    """The canonical bytes a server signs for one step."""
    return msgpack.packb([STEP_DOMAIN, model_id, start, end, position, tokens, input_digest, output_digest],
                         use_bin_type=True)


def sign_step(key_pair: KeyPair, model_id: str, start: int, end: int, position: int, tokens: int,
              input_digest: bytes, output_digest: bytes) -> bytes:
    return key_pair.private_key.sign(
        statement(model_id, start, end, position, tokens, input_digest, output_digest))


def verify_step(peer_id: str, signature: bytes, model_id: str, start: int, end: int, position: int,
                tokens: int, input_digest: bytes, output_digest: bytes) -> bool:
    try:
        key = ID.from_base58(peer_id).extract_public_key()
        return key is not None and bool(key.verify(
            statement(model_id, start, end, position, tokens, input_digest, output_digest), signature))
    except Exception:  # a malformed peer id or signature is simply not valid
        return False


def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    """‖a − b‖₂ / max(‖b‖₂, ε), in float64: how far one output is from another."""
    a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    if a64.shape != b64.shape:
        return float("inf")
    return float(np.linalg.norm(a64 - b64) / max(np.linalg.norm(b64), 1e-12))


@dataclasses.dataclass(frozen=True)
class StepClaim:
    """One server's signed answer to a step: its output bytes and its signature."""

    peer_id: str
    dtype: str
    output: bytes  # the step's output, raw little-endian `dtype`, tokens × hidden values
    signature: bytes

    def array(self) -> np.ndarray:
        return np.frombuffer(self.output, dtype=WIRE_NUMPY_DTYPES[self.dtype])

    def to_wire(self) -> dict:
        return {"peer": self.peer_id, "dtype": self.dtype, "output": self.output, "sig": self.signature}


@dataclasses.dataclass(frozen=True)
class FailureReport:
    """Two signed, conflicting answers to the same step of the same input stream.

    `accused` is the server the reporter excluded (the checked one); the report
    itself proves only that the two disagree.
    """

    model_id: str
    start: int
    end: int
    position: int
    tokens: int
    input_digest: bytes
    accused: StepClaim
    witness: StepClaim
    tolerance: float = DEFAULT_TOLERANCE

    def error(self) -> float:
        if self.accused.dtype == "bfloat16" or self.witness.dtype == "bfloat16":
            return float("inf")  # reports carry float32/float16 outputs only
        return relative_error(self.accused.array(), self.witness.array())

    def check(self) -> None:
        """Raise PeerMisbehaved unless both claims are signed and really conflict."""
        if self.accused.peer_id == self.witness.peer_id:
            raise PeerMisbehaved("a failure report needs two different servers")
        for claim in (self.accused, self.witness):
            if claim.dtype not in ("float32", "float16"):
                raise PeerMisbehaved(f"report output dtype {claim.dtype!r} is not float32/float16")
            if len(claim.output) % WIRE_NUMPY_DTYPES[claim.dtype].itemsize:
                raise PeerMisbehaved("report output length is not a whole number of values")
            if not verify_step(claim.peer_id, claim.signature, self.model_id, self.start, self.end,
                               self.position, self.tokens, self.input_digest,
                               hashlib.sha256(claim.output).digest()):
                raise PeerMisbehaved(f"the claim of {claim.peer_id} is not signed by it")
        if not self.error() > self.tolerance:
            raise PeerMisbehaved("the two outputs agree within the tolerance: nothing to report")

    def to_wire(self) -> bytes:
        return msgpack.packb({
            "format": REPORT_FORMAT, "model": self.model_id, "start": self.start, "end": self.end,
            "position": self.position, "tokens": self.tokens, "input_digest": self.input_digest,
            "accused": self.accused.to_wire(), "witness": self.witness.to_wire(), "tolerance": self.tolerance,
        }, use_bin_type=True)

    @classmethod
    def from_wire(cls, data: bytes) -> FailureReport:
        """Parse (not check: call check()) a report from anyone."""
        if not isinstance(data, bytes | bytearray) or len(data) > MAX_REPORT_BYTES:
            raise PeerMisbehaved("a failure report is at most 4 MiB of bytes")
        try:
            body = msgpack.unpackb(data, raw=False, strict_map_key=True)
            if body["format"] != REPORT_FORMAT:
                raise ValueError(f"format {body['format']!r}")
            claims = []
            for name in ("accused", "witness"):
                c = body[name]
                claims.append(StepClaim(_typed(c["peer"], str), _typed(c["dtype"], str),
                                        _typed(c["output"], bytes), _typed(c["sig"], bytes)))
            report = cls(_typed(body["model"], str), _typed(body["start"], int), _typed(body["end"], int),
                         _typed(body["position"], int), _typed(body["tokens"], int),
                         _typed(body["input_digest"], bytes), claims[0], claims[1],
                         float(_typed(body["tolerance"], float | int)))
        except PeerMisbehaved:
            raise
        except Exception as exc:
            raise PeerMisbehaved(f"malformed failure report: {exc}") from None
        if not (0 <= report.start < report.end and report.position >= 0 and report.tokens >= 1
                and len(report.input_digest) == 32 and 0 < report.tolerance < 1):
            raise PeerMisbehaved("failure report fields out of range")
        return report

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.to_wire()).hexdigest()


def _typed(value, kind):
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"{value!r:.40} has the wrong type")
    return value
