"""Signed step outputs of inference and their failure reports. Pure, no I/O.

A server signs every step it answers (version 3 of the statement):

    ["compushare/step-proof/v3", mode, runtime, model, start, end, position, tokens,
     prefix, forwards, input, output]

"computing in `mode` (fp32: its tolerance is fixed by TOLERANCES) on `runtime` (the
span runtime's build, spans.SpanCompute.build), blocks start:end of model M, after
inputs whose chain is `prefix`, computed in the forwards whose chain is `forwards`,
the input of positions position..position+tokens-1 with digest `input` gives the
output with digest `output`". Digests are built from one digest per token row,
which names the row's dtype:

    t      = SHA-256(dtype || 0x00 || the row's little-endian bytes)
    digest = SHA-256(t_position || ... || t_position+tokens-1)     (a step's input or output)
    c_0    = 32 zero bytes;  c_i+1 = SHA-256(c_i || t_i)           (the input chain)
    f_0    = 32 zero bytes;  f_k+1 = SHA-256(f_k || u32be(n_k))    (the forwards chain)

where `prefix` is c_position, n_k is the number of tokens of the session's k-th
forward (a rollback into a forward adds a link of 0xFFFFFFFF then the rows kept of
it), and `forwards` is the chain through this step's own forward. So a proof

- covers the dtype and the shape of what it signs: relabelling an output's dtype
  or cutting its rows breaks the signature;
- survives a rollback: the chain is kept per position, and a truncate cuts it
  back (speculation truncates KV caches);
- can be linked without the bytes: server 2's signed `input` of a step is server
  1's signed `output` of it when server 2 was given exactly server 1's output.

Two such claims with the same statement up to `output` (their runtimes and forwards
aside), whose outputs differ beyond the tolerance, prove that one of the two servers
computed wrongly: a failure report anyone can check. The tolerance is none at all when
both claims name one exact runtime build (a ggml build: the same kernels give the same
bits, threads aside) and the same forwards (a forward of other sizes rounds
differently, so a verifier caught up in a batch is not held to bits);
ACROSS_RUNTIMES[mode] when they name two runtimes; else TOLERANCES[mode]. The reporter
chooses nothing the verdict rests on: the tolerance is the protocol's, not the report's. Training's statements and
reports are in training.py, private mode's in private.py, DiLoCo's in diloco.py;
reports.py's parse_report reads every kind.
"""

from __future__ import annotations

import dataclasses
import hashlib

import msgpack
import numpy as np

from ..errors import PeerMisbehaved
from ..net.dtypes import WIRE_NUMPY_DTYPES
from .fields import (DIGEST_BYTES, MAX_REPORT_BYTES, PeerSigned, WireReport, exact_map, malformed, report_body,
                     report_wire, typed)

STEP_DOMAIN = "compushare/step-proof/v3"
REPORT_FORMAT = "compushare/failure-report/v3"
MAX_RUNTIME_CHARS = 48  # "ggml/<version>:<8 hex>", "torch/<version>"
EXACT_RUNTIMES = ("ggml/",)  # builds whose name pins the kernels, so honest answers are bit-equal
CUT = 0xFFFFFFFF  # the forwards chain's marker of a rollback into a forward
# Relative L2 error two honest servers' outputs of one step may differ by, per compute
# mode: the span's weight format (protocol.md's table). fp32: chunking alone gives
# ~1e-5 on SmolLM2. bf16, int8 and q4 round activations to bfloat16 before each product:
# the same format on the same kernels is batch- and chunk-invariant here (0 difference),
# but another CPU's kernels may round differently, and rounding alone moves a 2-block
# span's output by ~5e-3 (fp32 against q4/g32 holding the very same weights), while
# serving a cheaper format moves it by ~5e-2 (q4/g64 against int8): 2e-2 lies between.
# That figure is for a few blocks; rounding differences grow with depth (a kernel
# against the dequantized fallback on SmolLM2 q4: 5.5e-3 over 2 blocks, 1.4e-2 over
# 10, 4.3e-2 over 30), so these modes allow 2e-3 per block of the span where that is
# more: 6e-2 for 30 blocks.
TOLERANCES = {"fp32": 1e-3} | {label: 2e-2 for label in ("bf16", "int8", "q4/g32", "q4/g64", "q4/g128", "gguf")}
TOLERANCE_PER_BLOCK = {label: 2e-3 for label in TOLERANCES if label != "fp32"}
# Between two runtimes (torch against ggml on one GGUF model): ggml quantizes activations
# to 8 bits before each quantized product and keeps K and V in float16, torch rounds them
# to bfloat16. Measured on SmolLM2's Q4_1 GGUF (real activations, a 31-token prompt then
# 12 tokens): up to 1.5e-2 over 2 blocks, 2.6e-2 over 10, 3.6e-2 over 30; random inputs
# 1.9e-2, 4.5e-2, 5.6e-2. The gguf mode's 2e-2 would make honest mixed pairs disagree.
ACROSS_RUNTIMES = {"gguf": (6e-2, 4e-3)}  # mode -> (tolerance, per block where that is more)
DEFAULT_MODE = "fp32"
DEFAULT_TOLERANCE = TOLERANCES[DEFAULT_MODE]
REPORT_DTYPES = ("float32", "float16")  # reports compare these; bfloat16 outputs are not reportable
GENESIS = bytes(DIGEST_BYTES)


def tolerance(mode: str, blocks: int) -> float:
    """The protocol's tolerance for two honest outputs of a span of `blocks` blocks
    computed in `mode` (KeyError for a mode without one)."""
    return max(TOLERANCES[mode], TOLERANCE_PER_BLOCK.get(mode, 0.0) * blocks)


def tolerance_between(mode: str, blocks: int, a: tuple[str, bytes], b: tuple[str, bytes]) -> float:
    """The tolerance for two honest outputs of one step whose servers name (runtime,
    forwards) `a` and `b`: none when both are one exact build computing the same
    forwards; ACROSS_RUNTIMES' when they name two runtimes; else the mode's."""
    if a == b and a[0].startswith(EXACT_RUNTIMES):
        return 0.0
    runtimes = {a[0].split("/")[0], b[0].split("/")[0]}
    if len(runtimes) == 2 and "" not in runtimes and mode in ACROSS_RUNTIMES:
        base, per_block = ACROSS_RUNTIMES[mode]
        return max(base, per_block * blocks)
    return tolerance(mode, blocks)


def adapted_model(model_id: str, adapter_digest: bytes | None) -> str:
    """What a step proof's `model` names: the model id, and for a session with a LoRA
    adapter that adapter's digest (of the hop's slice). Adapted outputs differ from
    plain ones by design: without it a consumer could set one server's proof beside
    another's that it opened without the adapter, a "failure" of an honest server."""
    return model_id if adapter_digest is None else f"{model_id}+lora:{adapter_digest.hex()}"


def token_digests(dtype: str, data: bytes | memoryview, tokens: int) -> list[bytes]:
    """One digest per token row of `data` (`tokens` rows of `dtype` values)."""
    view = memoryview(data).cast("B")
    if tokens < 1 or len(view) % tokens:
        raise ValueError(f"{len(view)} bytes are not {tokens} equal rows")
    row, tag = len(view) // tokens, dtype.encode() + b"\x00"
    return [hashlib.sha256(tag + view[i * row:(i + 1) * row]).digest() for i in range(tokens)]


def rows_digest(digests: list[bytes]) -> bytes:
    """The digest of a step's input or output, from its rows' digests."""
    return hashlib.sha256(b"".join(digests)).digest()


def step_digest(dtype: str, data: bytes | memoryview, tokens: int) -> bytes:
    return rows_digest(token_digests(dtype, data, tokens))


class InputChain:
    """The chain c_0..c_n over a session's input rows, and the rows' digests, kept
    per position so that a truncate can cut them back (two 32-byte digests per
    token held: about 150 bytes with Python's objects)."""

    def __init__(self) -> None:
        self._links = [GENESIS]
        self._rows: list[bytes] = []
        self._forwards: list[tuple[int, bytes]] = [(0, GENESIS)]  # (rows held after it, f_k)

    def __len__(self) -> int:
        """How many input tokens the chain covers."""
        return len(self._rows)

    def extend(self, digests: list[bytes], forwards: tuple[int, ...] | list[int] | None = None) -> None:
        """Add one step's input rows, computed in forwards of `forwards` tokens each
        (one forward of them all by default)."""
        forwards = (len(digests),) if forwards is None else tuple(forwards)
        if sum(forwards) != len(digests) or min(forwards, default=1) < 1:
            raise ValueError(f"forwards {forwards} do not cover {len(digests)} rows")
        link = self._links[-1]
        for digest in digests:
            link = hashlib.sha256(link + digest).digest()
            self._links.append(link)
        self._rows.extend(digests)
        held, chain = self._forwards[-1]
        for n in forwards:
            held, chain = held + n, _forward_link(chain, n)
            self._forwards.append((held, chain))

    def forwards(self, position: int) -> bytes:
        """f through the forward that ends at `position` (a step's last chunk)."""
        for held, chain in reversed(self._forwards):
            if held == position:
                return chain
            if held < position:
                break
        raise ValueError(f"no forward ends at position {position}")

    def at(self, position: int) -> bytes:
        """c_position: the chain over the first `position` inputs."""
        return self._links[position]

    def digest(self, position: int, tokens: int) -> bytes:
        """The input digest of positions position..position+tokens-1."""
        if not (0 <= position and tokens >= 1 and position + tokens <= len(self)):
            raise ValueError(f"positions {position}+{tokens} are not all held ({len(self)})")
        return rows_digest(self._rows[position:position + tokens])

    def truncate(self, position: int) -> None:
        if not 0 <= position <= len(self):
            raise ValueError(f"cannot cut a chain of {len(self)} back to {position}")
        del self._links[position + 1:]
        del self._rows[position:]
        while self._forwards[-1][0] > position:
            self._forwards.pop()
        held, chain = self._forwards[-1]
        if held < position:  # kept part of a forward: its rows were computed among more
            self._forwards.append((position, _forward_link(_forward_link(chain, CUT), position - held)))


def _forward_link(chain: bytes, n: int) -> bytes:
    return hashlib.sha256(chain + n.to_bytes(4, "big")).digest()


@dataclasses.dataclass(frozen=True)
class Statement(PeerSigned):
    """What a server signs for one step (see the module docstring)."""

    mode: str
    model_id: str
    start: int
    end: int
    position: int
    tokens: int
    prefix: bytes
    input_digest: bytes
    output_digest: bytes
    runtime: str = ""  # "" names no build: never compared exactly
    forwards: bytes = GENESIS

    def encode(self) -> bytes:
        return msgpack.packb([STEP_DOMAIN, self.mode, self.runtime, self.model_id, self.start, self.end,
                              self.position, self.tokens, self.prefix, self.forwards, self.input_digest,
                              self.output_digest], use_bin_type=True)


def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    """‖a − b‖₂ / max(‖b‖₂, ε), in float64: how far one output is from another."""
    a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    if a64.shape != b64.shape:
        return float("inf")
    return float(np.linalg.norm(a64 - b64) / max(float(np.linalg.norm(b64)), 1e-12))


@dataclasses.dataclass(frozen=True)
class StepClaim:
    """One server's signed answer to a step: its output bytes and its signature."""

    peer_id: str
    dtype: str
    output: bytes  # the step's output, raw little-endian `dtype`, tokens × hidden values
    signature: bytes
    runtime: str = ""
    forwards: bytes = GENESIS

    def array(self) -> np.ndarray:
        return np.frombuffer(self.output, dtype=WIRE_NUMPY_DTYPES[self.dtype])

    def to_wire(self) -> dict:
        return {"peer": self.peer_id, "dtype": self.dtype, "output": self.output, "sig": self.signature,
                "rt": self.runtime, "forwards": self.forwards}


@dataclasses.dataclass(frozen=True)
class FailureReport(WireReport):
    """Two signed, conflicting answers to the same step of the same input chain.

    `accused` is the server the reporter excluded (the checked one); the report
    itself proves only that the two disagree.
    """

    mode: str
    model_id: str
    start: int
    end: int
    position: int
    tokens: int
    prefix: bytes
    input_digest: bytes
    accused: StepClaim
    witness: StepClaim

    @property
    def tolerance(self) -> float:
        return tolerance_between(self.mode, self.end - self.start, (self.accused.runtime, self.accused.forwards),
                                 (self.witness.runtime, self.witness.forwards))

    def statement(self, claim: StepClaim) -> Statement:
        """What `claim`'s server must have signed for its output."""
        return Statement(self.mode, self.model_id, self.start, self.end, self.position, self.tokens, self.prefix,
                         self.input_digest, step_digest(claim.dtype, claim.output, self.tokens), claim.runtime,
                         claim.forwards)

    def error(self) -> float:
        if self.accused.dtype not in REPORT_DTYPES or self.witness.dtype not in REPORT_DTYPES:
            return float("inf")
        return relative_error(self.accused.array(), self.witness.array())

    def check(self) -> None:
        """Raise PeerMisbehaved unless both claims are signed and really conflict."""
        if self.accused.peer_id == self.witness.peer_id:
            raise PeerMisbehaved("a failure report needs two different servers")
        if self.mode not in TOLERANCES:
            raise PeerMisbehaved(f"compute mode {self.mode!r} has no tolerance in the protocol")
        for claim in (self.accused, self.witness):
            if claim.dtype not in REPORT_DTYPES:
                raise PeerMisbehaved(f"report output dtype {claim.dtype!r} is not float32/float16")
            if not claim.output or len(claim.output) % (WIRE_NUMPY_DTYPES[claim.dtype].itemsize * self.tokens):
                raise PeerMisbehaved("report output is not a whole number of values in every token row")
            if not self.statement(claim).verify(claim.peer_id, claim.signature):
                raise PeerMisbehaved(f"the claim of {claim.peer_id} is not signed by it")
        if self.accused.array().size != self.witness.array().size:
            raise PeerMisbehaved("the two outputs have different shapes: not answers to one step")
        if not self.error() > self.tolerance:
            raise PeerMisbehaved("the two outputs agree within the tolerance: nothing to report")

    def to_wire(self) -> bytes:
        return report_wire(REPORT_FORMAT, {
            "mode": self.mode, "model": self.model_id, "start": self.start, "end": self.end,
            "position": self.position, "tokens": self.tokens, "prefix": self.prefix, "input_digest": self.input_digest,
        }, self.accused.to_wire(), self.witness.to_wire())

    @classmethod
    def from_wire(cls, data: bytes) -> FailureReport:
        """Parse (not check: call check()) a report from anyone."""
        body, accused, witness = report_body(data, REPORT_FORMAT, _REPORT_KEYS, _step_claim,
                                             max_bytes=MAX_REPORT_BYTES, what="failure report")
        with malformed("failure report"):
            report = cls(typed(body["mode"], str), typed(body["model"], str), typed(body["start"], int),
                         typed(body["end"], int), typed(body["position"], int), typed(body["tokens"], int),
                         typed(body["prefix"], bytes), typed(body["input_digest"], bytes), accused, witness)
        if not (0 <= report.start < report.end and report.position >= 0 and report.tokens >= 1
                and len(report.prefix) == DIGEST_BYTES and len(report.input_digest) == DIGEST_BYTES):
            raise PeerMisbehaved("failure report fields out of range")
        return report


_REPORT_KEYS = {"format", "mode", "model", "start", "end", "position", "tokens", "prefix", "input_digest",
                "accused", "witness"}
_CLAIM_KEYS = {"peer", "dtype", "output", "sig", "rt", "forwards"}


def _step_claim(value: object, name: str) -> StepClaim:
    body = exact_map(value, _CLAIM_KEYS, name)
    claim = StepClaim(typed(body["peer"], str), typed(body["dtype"], str), typed(body["output"], bytes),
                      typed(body["sig"], bytes), typed(body["rt"], str), typed(body["forwards"], bytes))
    if len(claim.runtime) > MAX_RUNTIME_CHARS or len(claim.forwards) != DIGEST_BYTES:
        raise ValueError(f"{name}'s runtime or forwards out of range")
    return claim

