"""The messages of /compushare/infer/1.5.0, typed. Pure: no I/O, no torch, no libp2p.

Every request and reply is a frozen dataclass with `to_wire()` (the msgpack map of
protocol.md). `decode_request` and `decode_reply` are the only readers of those
maps: they check a message once, at the edge, and what comes out is typed.

A request that fails a check raises FrameError with the error reply's code and
message (`bad_request` for a missing or mistyped field or an unknown type; the
tensor codes for a hidden state that is not a tensor on the wire; `bad_receipt`
for a receipt that is not bytes). A reply that fails one raises PeerMisbehaved.

Hidden states stay as they came, a `WireTensor` (dtype, shape, bytes): what they
must hold (the span's hidden size, at most so many tokens, finite values) depends
on who reads them, so `net.tensors.decode_tensor` checks that when it builds the
tensor, after the session it belongs to has been found.
"""

from __future__ import annotations

import dataclasses
from typing import Union

from ..errors import FrameError, PeerMisbehaved
from ..karma.receipts import MAX_RECEIPT_BYTES
from ..net.dtypes import WIRE_NUMPY_DTYPES
from . import protocol
from .protocol import BAD_REQUEST, SESSION_ID_BYTES

MAX_ADDRS = 8  # multiaddrs in a link's downstream
MAX_ADDR_CHARS = 256
MAX_PEER_CHARS = 128
MAX_FORMAT_CHARS = 16  # a weight format label, "q4/g128" at most
_BASE58 = frozenset("123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz")


# ---------------------------------------------------------------- parts


@dataclasses.dataclass(frozen=True)
class WireTensor:
    """A hidden state as it travels: [1, tokens, hidden] of `dtype`, little-endian bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    @property
    def tokens(self) -> int:
        return self.shape[1]

    def to_wire(self) -> dict:
        return {"dtype": self.dtype, "shape": list(self.shape), "data": self.data}

    @classmethod
    def from_wire(cls, obj: object) -> WireTensor:
        """The structure checks of net.tensors.decode_tensor, with its codes and messages:
        a map of exactly dtype (on the whitelist), shape (3 integers), data (bytes)."""
        if not isinstance(obj, dict) or set(obj) != {"dtype", "shape", "data"}:
            raise FrameError("bad_tensor", "a tensor is a map of exactly dtype, shape, data")
        dtype, shape, data = obj["dtype"], obj["shape"], obj["data"]
        if not isinstance(dtype, str) or dtype not in WIRE_NUMPY_DTYPES:
            raise FrameError("bad_dtype", f"dtype {dtype!r} is not one of {sorted(WIRE_NUMPY_DTYPES)}")
        if (not isinstance(shape, list) or len(shape) != 3
                or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape)):
            raise FrameError("bad_shape", f"shape must be 3 integers [batch, tokens, hidden], got {shape!r}")
        if not isinstance(data, bytes):
            raise FrameError("bad_tensor", "tensor data must be bytes")
        return cls(dtype, tuple(shape), data)


@dataclasses.dataclass(frozen=True)
class Downstream:
    """Where a session's outputs go: the next hop's server and its session."""

    peer: str
    addrs: tuple[str, ...]
    session: bytes

    def to_wire(self) -> dict:
        return {"peer": self.peer, "addrs": list(self.addrs), "session": self.session}

    @classmethod
    def from_wire(cls, value: object) -> Downstream | None:
        if value is None:
            return None
        if not isinstance(value, dict):
            raise FrameError(BAD_REQUEST, "'downstream' must be a map or nil")
        peer = parse_peer(value.get("peer"), "downstream.peer")
        addrs, session = value.get("addrs"), value.get("session")
        if (not isinstance(addrs, list) or len(addrs) > MAX_ADDRS
                or not all(isinstance(a, str) and len(a) <= MAX_ADDR_CHARS for a in addrs)):
            raise FrameError(BAD_REQUEST, f"'downstream.addrs' must be at most {MAX_ADDRS} multiaddr strings")
        if not isinstance(session, bytes) or len(session) != SESSION_ID_BYTES:
            raise FrameError(BAD_REQUEST, f"'downstream.session' must be {SESSION_ID_BYTES} bytes")
        return cls(peer, tuple(addrs), session)


@dataclasses.dataclass(frozen=True)
class Proof:
    """A step proof (proofs.py): the server's signed statement about the last chunk."""

    position: int
    tokens: int
    mode: str
    prefix: bytes
    input_digest: bytes
    output_digest: bytes
    sig: bytes

    def to_wire(self) -> dict:
        return {"position": self.position, "tokens": self.tokens, "mode": self.mode, "prefix": self.prefix,
                "input": self.input_digest, "output": self.output_digest, "sig": self.sig}

    @classmethod
    def from_wire(cls, value: object) -> Proof | None:
        """None unless a map of these typed fields: a proof that cannot be read cannot
        convict anyone, so it counts as none."""
        if not isinstance(value, dict):
            return None
        position, tokens, mode, prefix, digest, output, sig = (
            value.get(k) for k in ("position", "tokens", "mode", "prefix", "input", "output", "sig"))
        if not (_is_int(position) and _is_int(tokens) and isinstance(mode, str) and len(mode) <= 16
                and all(isinstance(d, bytes) and len(d) == 32 for d in (prefix, digest, output))
                and isinstance(sig, bytes) and len(sig) <= 128):
            return None
        return cls(position, tokens, mode, prefix, digest, output, sig)


def parse_peer(value: object, name: str) -> str:
    """A peer id in base58, as libp2p's ID.from_base58 accepts it (trailing whitespace
    and all), without importing libp2p here."""
    if not isinstance(value, str) or len(value) > MAX_PEER_CHARS:
        raise FrameError(BAD_REQUEST, f"{name!r} must be a peer id")
    if not all(c in _BASE58 for c in value.rstrip()):
        raise FrameError(BAD_REQUEST, f"{name!r} is not a valid peer id")
    return value


# ---------------------------------------------------------------- requests


@dataclasses.dataclass(frozen=True)
class OpenRequest:
    session: bytes
    model: str | None  # None: absent or not a string (answered "wrong model", as any other model)
    start: int
    end: int
    max_tokens: int

    def to_wire(self) -> dict:
        return {"type": "open", "session": self.session, "model": self.model, "start": self.start,
                "end": self.end, "max_tokens": self.max_tokens}


@dataclasses.dataclass(frozen=True)
class FromUpstream:
    """A step whose input is not in the request: it is the output the session's
    upstream server pushes for this position (direct return)."""

    tokens: int
    wait_ms: int  # how long the server waits for that push before answering `no_input`

    def to_wire(self) -> dict:
        return {"tokens": self.tokens, "wait_ms": self.wait_ms}

    @classmethod
    def from_wire(cls, value: object) -> FromUpstream:
        if not isinstance(value, dict) or set(value) != {"tokens", "wait_ms"}:
            raise FrameError(BAD_REQUEST, "'from_upstream' is a map of exactly tokens, wait_ms")
        tokens, wait_ms = value["tokens"], value["wait_ms"]
        if not (_is_int(tokens) and tokens >= 1 and _is_int(wait_ms) and 0 <= wait_ms <= protocol.MAX_WAIT_MS):
            raise FrameError(BAD_REQUEST, f"'from_upstream' needs tokens >= 1 and wait_ms 0..{protocol.MAX_WAIT_MS}")
        return cls(tokens, wait_ms)


@dataclasses.dataclass(frozen=True)
class StepRequest:
    session: bytes
    position: int
    hidden: WireTensor | None  # None: the input comes `from_upstream`
    chunks: tuple[int, ...] | None = None  # None: absent, one chunk of every token
    last_only: bool = False
    rollback: bool = False  # a session holding more than `position` tokens is first cut back to it
    from_upstream: FromUpstream | None = None

    @property
    def tokens(self) -> int:
        return self.hidden.tokens if self.hidden is not None else self.from_upstream.tokens

    @property
    def sizes(self) -> list[int]:
        """The chunk sizes the step runs as."""
        return list(self.chunks) if self.chunks is not None else [self.tokens]

    @property
    def reply_tokens(self) -> int:
        """How many tokens the result carries: the last chunk's with last_only, else all."""
        return self.sizes[-1] if self.last_only else self.tokens

    def to_wire(self) -> dict:
        wire = {"type": "step", "session": self.session, "position": self.position}
        if self.hidden is not None:
            wire["hidden"] = self.hidden.to_wire()
        else:
            wire["from_upstream"] = self.from_upstream.to_wire()
        if self.chunks is not None:
            wire["chunks"] = list(self.chunks)
        if self.last_only:
            wire["last_only"] = True
        if self.rollback:
            wire["rollback"] = True
        return wire


@dataclasses.dataclass(frozen=True)
class PushRequest:
    """Server to server: the upstream hop's output, the input of this session's next step."""

    session: bytes
    position: int
    hidden: WireTensor

    def to_wire(self) -> dict:
        return {"type": "push", "session": self.session, "position": self.position, "hidden": self.hidden.to_wire()}


@dataclasses.dataclass(frozen=True)
class LinkRequest:
    session: bytes
    upstream: str | None
    downstream: Downstream | None

    def to_wire(self) -> dict:
        return {"type": "link", "session": self.session, "upstream": self.upstream,
                "downstream": None if self.downstream is None else self.downstream.to_wire()}


@dataclasses.dataclass(frozen=True)
class TruncateRequest:
    session: bytes
    position: int

    def to_wire(self) -> dict:
        return {"type": "truncate", "session": self.session, "position": self.position}


@dataclasses.dataclass(frozen=True)
class ReceiptRequest:
    session: bytes
    receipt: bytes  # consumer-signed (karma.receipts); checked by whoever countersigns it

    def to_wire(self) -> dict:
        return {"type": "receipt", "session": self.session, "receipt": self.receipt}


@dataclasses.dataclass(frozen=True)
class CloseRequest:
    session: bytes

    def to_wire(self) -> dict:
        return {"type": "close", "session": self.session}


Request = Union[OpenRequest, StepRequest, PushRequest, LinkRequest, TruncateRequest, ReceiptRequest, CloseRequest]


def decode_request(message: object) -> Request:
    """The typed request, or FrameError with the error reply's code and message.
    Checked in order: the session id, the type, then the type's fields in the order
    protocol.md lists them."""
    if not isinstance(message, dict):
        raise FrameError("bad_frame", "a frame must be a map with a string 'type'")
    session = message.get("session")
    if not isinstance(session, bytes) or len(session) != SESSION_ID_BYTES:
        raise FrameError(BAD_REQUEST, f"'session' must be {SESSION_ID_BYTES} bytes")
    kind = message.get("type")
    decode = _REQUESTS.get(kind) if isinstance(kind, str) else None
    if decode is None:
        raise FrameError(BAD_REQUEST, f"unknown message type {kind!r}")
    return decode(message, session)


def echo_session(message: object) -> bytes | None:
    """The session an error reply names: the request's `session` if it is bytes at all."""
    session = message.get("session") if isinstance(message, dict) else None
    return session if isinstance(session, bytes) else None


def _open(m: dict, session: bytes) -> OpenRequest:
    model = m.get("model")
    return OpenRequest(session, model if isinstance(model, str) else None, _int(m, "start"), _int(m, "end"),
                       _int(m, "max_tokens"))


def _step(m: dict, session: bytes) -> StepRequest:
    position = _int(m, "position")
    if "from_upstream" in m:  # direct return: the upstream server's push is the input
        if "hidden" in m or "chunks" in m:
            raise FrameError(BAD_REQUEST, "a step 'from_upstream' carries no 'hidden' and no 'chunks'")
        return StepRequest(session, position, None, None, m.get("last_only", False) is True,
                           m.get("rollback", False) is True, FromUpstream.from_wire(m["from_upstream"]))
    hidden = WireTensor.from_wire(m.get("hidden"))
    chunks = m.get("chunks")
    if chunks is not None:
        if (not isinstance(chunks, list) or not chunks or not all(_is_int(c) and c >= 1 for c in chunks)
                or sum(chunks) != hidden.tokens):
            raise FrameError(BAD_REQUEST, f"'chunks' must be positive integers summing to {hidden.tokens}")
        chunks = tuple(chunks)
    return StepRequest(session, position, hidden, chunks, m.get("last_only", False) is True,
                       m.get("rollback", False) is True)


def _push(m: dict, session: bytes) -> PushRequest:
    return PushRequest(session, _int(m, "position"), WireTensor.from_wire(m.get("hidden")))


def _link(m: dict, session: bytes) -> LinkRequest:
    upstream = m.get("upstream")
    upstream = None if upstream is None else parse_peer(upstream, "upstream")
    return LinkRequest(session, upstream, Downstream.from_wire(m.get("downstream")))


def _truncate(m: dict, session: bytes) -> TruncateRequest:
    return TruncateRequest(session, _int(m, "position"))


def _receipt(m: dict, session: bytes) -> ReceiptRequest:
    receipt = m.get("receipt")
    if not isinstance(receipt, bytes):  # karma.receipts.parse_receipt's words for it
        raise FrameError(protocol.BAD_RECEIPT, f"a receipt is at most {MAX_RECEIPT_BYTES} bytes")
    return ReceiptRequest(session, receipt)


def _close(m: dict, session: bytes) -> CloseRequest:
    return CloseRequest(session)


_REQUESTS = {"open": _open, "step": _step, "push": _push, "link": _link, "truncate": _truncate,
             "receipt": _receipt, "close": _close}


# ---------------------------------------------------------------- replies


@dataclasses.dataclass(frozen=True)
class Opened:
    session: bytes
    free_tokens: int
    format: str = ""  # the weight format the span computes in ("fp32", "q4/g64", ...); "" = unsaid

    def to_wire(self) -> dict:
        return {"type": "opened", "session": self.session, "free_tokens": self.free_tokens} | (
            {"format": self.format} if self.format else {})


@dataclasses.dataclass(frozen=True)
class Result:
    session: bytes
    position: int
    hidden: WireTensor
    compute_ms: float
    proof: Proof | None = None  # none after a truncate that dropped tokens

    def to_wire(self) -> dict:
        wire = {"type": "result", "session": self.session, "position": self.position,
                "hidden": self.hidden.to_wire(), "compute_ms": self.compute_ms}
        if self.proof is not None:
            wire["proof"] = self.proof.to_wire()
        return wire


@dataclasses.dataclass(frozen=True)
class Linked:
    session: bytes

    def to_wire(self) -> dict:
        return {"type": "linked", "session": self.session}


@dataclasses.dataclass(frozen=True)
class Truncated:
    session: bytes
    position: int

    def to_wire(self) -> dict:
        return {"type": "truncated", "session": self.session, "position": self.position}


@dataclasses.dataclass(frozen=True)
class Receipted:
    session: bytes
    receipt: bytes  # countersigned

    def to_wire(self) -> dict:
        return {"type": "receipted", "session": self.session, "receipt": self.receipt}


@dataclasses.dataclass(frozen=True)
class Closed:
    session: bytes

    def to_wire(self) -> dict:
        return {"type": "closed", "session": self.session}


@dataclasses.dataclass(frozen=True)
class ErrorReply:
    code: str
    message: str
    session: bytes | None = None
    retry_after_s: float | None = None  # rate_limited only

    def to_wire(self) -> dict:
        wire = protocol.error(self.code, self.message, self.session)
        if self.retry_after_s is not None:
            wire["retry_after_s"] = self.retry_after_s
        return wire


Reply = Union[Opened, Result, Linked, Truncated, Receipted, Closed, ErrorReply]

_ANSWERS = {OpenRequest: ("open", "opened"), StepRequest: ("step", "result"), PushRequest: ("push", None),
            LinkRequest: ("link", "linked"), TruncateRequest: ("truncate", "truncated"),
            ReceiptRequest: ("receipt", "receipted"), CloseRequest: ("close", "closed")}


def decode_reply(message: object, request: Request | None = None) -> Reply:
    """The typed reply, or PeerMisbehaved.

    An error reply is read as leniently as the consumer always has: code and message
    as text, the retry delay if it is a number. A result's `compute_ms` that is not a
    number counts as 0, a `proof` that cannot be read as none. Given the `request` it
    answers, the reply must be that request's answer or an error; a step's result is
    at the step's position and carries the tokens the step asked back."""
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise PeerMisbehaved("a reply is a map with a string 'type'")
    kind = message["type"]
    if kind == "error":
        session, wait = message.get("session"), message.get("retry_after_s")
        return ErrorReply(str(message.get("code")), str(message.get("message")),
                          session if isinstance(session, bytes) else None,
                          float(wait) if isinstance(wait, float | int) else None)
    if request is not None:
        name, answer = _ANSWERS[type(request)]
        if kind != answer or (answer == "result" and message.get("position") != request.position):
            raise PeerMisbehaved(f"answered {name} {request.position} with {kind}" if answer == "result"
                                 else f"answered {name} with {kind}")
    decode = _REPLIES.get(kind)
    if decode is None:
        raise PeerMisbehaved(f"unknown reply type {kind!r}")
    session = message.get("session")
    if not isinstance(session, bytes) or len(session) != SESSION_ID_BYTES:
        raise PeerMisbehaved(f"a reply's 'session' must be {SESSION_ID_BYTES} bytes")
    reply = decode(message, session)
    if isinstance(request, StepRequest) and reply.hidden.tokens != request.reply_tokens:
        raise PeerMisbehaved(f"returned {reply.hidden.tokens} tokens for {request.reply_tokens}")
    return reply


def _reply_int(message: dict, name: str) -> int:
    value = message.get(name)
    if not _is_int(value) or value < 0:
        raise PeerMisbehaved(f"a reply's {name!r} must be a non-negative integer")
    return value


def _result(m: dict, session: bytes) -> Result:
    position, hidden = _reply_int(m, "position"), WireTensor.from_wire(m.get("hidden"))
    compute_ms = m.get("compute_ms")
    return Result(session, position, hidden, float(compute_ms) if isinstance(compute_ms, float | int) else 0.0,
                  Proof.from_wire(m.get("proof")))


def _receipted(m: dict, session: bytes) -> Receipted:
    receipt = m.get("receipt")
    if not isinstance(receipt, bytes):
        raise PeerMisbehaved(f"a receipt is at most {MAX_RECEIPT_BYTES} bytes")
    return Receipted(session, receipt)


def _opened(m: dict, session: bytes) -> Opened:
    fmt = m.get("format", "")
    if not isinstance(fmt, str) or len(fmt) > MAX_FORMAT_CHARS:
        raise PeerMisbehaved(f"a reply's 'format' must be a string of at most {MAX_FORMAT_CHARS} characters")
    return Opened(session, _reply_int(m, "free_tokens"), fmt)


_REPLIES = {"opened": _opened, "result": _result,
            "linked": lambda m, s: Linked(s), "truncated": lambda m, s: Truncated(s, _reply_int(m, "position")),
            "receipted": _receipted, "closed": lambda m, s: Closed(s)}


# ---------------------------------------------------------------- fields


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(message: dict, name: str) -> int:
    value = message.get(name)
    if not _is_int(value) or value < 0:
        raise FrameError(BAD_REQUEST, f"{name!r} must be a non-negative integer")
    return value
