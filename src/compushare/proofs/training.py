"""Signed forwards and backwards of training (/compushare/train) and their failure
reports. Pure, no I/O.

A server signs every forward and backward it answers:

    ["compushare/train-proof/v1", mode, model, start, end, input, output]

"computing in `mode`, blocks start:end of model M, for the input digest `input`
(train_input_digest: the span's input, the output's gradient and the adapter's
digest) gives the gradients whose digest is `output`" (train_output_digest, over
the parts in order: "input" (the input's gradient) then each adapter tensor's by
name). Two such claims for one input whose parts differ beyond the mode's
tolerance (inference.py's, per mode and span), any part, make a TrainFailureReport.
"""

from __future__ import annotations

import dataclasses
import hashlib

import msgpack
import numpy as np

from ..errors import PeerMisbehaved
from .fields import (DIGEST_BYTES, MAX_REPORT_BYTES, PeerSigned, WireReport, malformed, report_body, report_wire,
                     typed)
from .inference import TOLERANCES, relative_error, tolerance

TRAIN_DOMAIN = "compushare/train-proof/v1"
TRAIN_REPORT_FORMAT = "compushare/train-failure-report/v1"
INPUT_PART = "input"  # a backward's first part: the span input's gradient
OUTPUT_PART = "output"  # a forward's one part: the span's output (signed the same way, input "grad" empty)


def train_input_digest(hidden: bytes, grad: bytes, adapter_digest: bytes) -> bytes:
    """Over the request's float32 bytes (the span's input and the output's gradient) and
    its adapter's digest (model/lora.py; empty without one)."""
    h = hashlib.sha256(b"compushare/train-input/v1\x00")
    for part in (hidden, grad, adapter_digest):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


def train_output_digest(parts: list[tuple[str, bytes]]) -> bytes:
    """Over a backward's gradients: (name, float32 bytes) in the reply's order."""
    h = hashlib.sha256(b"compushare/train-output/v1\x00")
    for name, data in parts:
        h.update(name.encode() + b"\x00" + len(data).to_bytes(8, "little"))
        h.update(data)
    return h.digest()


def parts_error(a: list[tuple[str, bytes]], b: list[tuple[str, bytes]]) -> float:
    """The largest relative error of any one float32 part of two training answers (a lie
    in a small gradient is not hidden by a large one); infinite for other parts."""
    if [name for name, _ in a] != [name for name, _ in b]:
        return float("inf")
    return max(relative_error(np.frombuffer(x, "<f4"), np.frombuffer(y, "<f4")) for (_, x), (_, y) in zip(a, b))


@dataclasses.dataclass(frozen=True)
class TrainStatement(PeerSigned):
    mode: str
    model_id: str
    start: int
    end: int
    input_digest: bytes
    output_digest: bytes

    def encode(self) -> bytes:
        return msgpack.packb([TRAIN_DOMAIN, self.mode, self.model_id, self.start, self.end, self.input_digest,
                              self.output_digest], use_bin_type=True)


@dataclasses.dataclass(frozen=True)
class TrainClaim:
    peer_id: str
    output: bytes  # every part's float32 bytes, in the report's order
    signature: bytes

    def to_wire(self) -> dict:
        return {"peer": self.peer_id, "output": self.output, "sig": self.signature}


@dataclasses.dataclass(frozen=True)
class TrainFailureReport(WireReport):
    """Two signed backwards of the same span and input whose gradients conflict."""

    mode: str
    model_id: str
    start: int
    end: int
    input_digest: bytes
    parts: tuple[tuple[str, int], ...]  # (name, float32 count) of each gradient, in order
    accused: TrainClaim
    witness: TrainClaim

    @property
    def tolerance(self) -> float:
        return tolerance(self.mode, self.end - self.start)

    def split(self, claim: TrainClaim) -> list[tuple[str, bytes]]:
        out, offset = [], 0
        for name, count in self.parts:
            out.append((name, claim.output[offset:offset + 4 * count]))
            offset += 4 * count
        return out

    def error(self) -> float:
        return parts_error(self.split(self.accused), self.split(self.witness))

    def check(self) -> None:
        if self.accused.peer_id == self.witness.peer_id:
            raise PeerMisbehaved("a failure report needs two different servers")
        if self.mode not in TOLERANCES:
            raise PeerMisbehaved(f"compute mode {self.mode!r} has no tolerance in the protocol")
        size = 4 * sum(count for _, count in self.parts)
        for claim in (self.accused, self.witness):
            if len(claim.output) != size:
                raise PeerMisbehaved("a claim's gradients are not the report's parts")
            statement = TrainStatement(self.mode, self.model_id, self.start, self.end, self.input_digest,
                                       train_output_digest(self.split(claim)))
            if not statement.verify(claim.peer_id, claim.signature):
                raise PeerMisbehaved(f"the claim of {claim.peer_id} is not signed by it")
        if not self.error() > self.tolerance:
            raise PeerMisbehaved("the two gradients agree within the tolerance: nothing to report")

    def to_wire(self) -> bytes:
        return report_wire(TRAIN_REPORT_FORMAT, {
            "mode": self.mode, "model": self.model_id, "start": self.start, "end": self.end,
            "input_digest": self.input_digest, "parts": [list(p) for p in self.parts],
        }, self.accused.to_wire(), self.witness.to_wire())

    @classmethod
    def from_wire(cls, data: bytes) -> TrainFailureReport:
        """Parse (not check: call check()) a report from anyone."""
        body, accused, witness = report_body(data, TRAIN_REPORT_FORMAT, _REPORT_KEYS, _claim,
                                             max_bytes=MAX_REPORT_BYTES, what="training failure report")
        with malformed("training failure report"):
            parts = tuple((typed(p[0], str), typed(p[1], int)) for p in body["parts"])
            report = cls(typed(body["mode"], str), typed(body["model"], str), typed(body["start"], int),
                         typed(body["end"], int), typed(body["input_digest"], bytes), parts, accused, witness)
        if not (0 <= report.start < report.end and parts and all(n >= 1 for _, n in parts)
                and len(report.input_digest) == DIGEST_BYTES):
            raise PeerMisbehaved("training failure report fields out of range")
        return report


_REPORT_KEYS = {"format", "mode", "model", "start", "end", "input_digest", "parts", "accused", "witness"}


def _claim(body, name: str) -> TrainClaim:
    # Any map with these keys: training reports never held their claims to exactly them.
    return TrainClaim(typed(body["peer"], str), typed(body["output"], bytes), typed(body["sig"], bytes))
