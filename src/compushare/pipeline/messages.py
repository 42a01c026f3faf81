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
from collections.abc import Callable

from .. import wire
from ..errors import FrameError, PeerMisbehaved
from ..karma.receipts import MAX_RECEIPT_BYTES
from . import protocol
from .message_parts import Downstream, Proof, WireTensor, is_int, parse_peer
from .protocol import BAD_REQUEST, SESSION_ID_BYTES

MAX_FORMAT_CHARS = 16  # a weight format label, "q4/g128" at most
ADAPTER_DIGEST_BYTES = 32  # SHA-256 (model/lora.py's Adapter.digest)


# ---------------------------------------------------------------- requests


@dataclasses.dataclass(frozen=True)
class OpenRequest:
    session: bytes
    model: str | None  # None: absent or not a string (answered "wrong model", as any other model)
    start: int
    end: int
    max_tokens: int
    # A LoRA adapter for this session's layers (pipeline/adapter_wire.py's map, as it
    # came: the server decodes it against its model and the span); None: none.
    adapter: dict | None = None

    def to_wire(self) -> dict:
        return {"type": "open", "session": self.session, "model": self.model, "start": self.start,
                "end": self.end, "max_tokens": self.max_tokens} | (
            {"adapter": self.adapter} if self.adapter is not None else {})


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
        if not (is_int(tokens) and tokens >= 1 and is_int(wait_ms) and 0 <= wait_ms <= protocol.MAX_WAIT_MS):
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
        if self.hidden is not None:
            return self.hidden.tokens
        assert self.from_upstream is not None  # one of the two, always (decode_request, the constructors)
        return self.from_upstream.tokens

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
        elif self.from_upstream is not None:
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


Request = OpenRequest | StepRequest | PushRequest | LinkRequest | TruncateRequest | ReceiptRequest | CloseRequest


def decode_request(message: object) -> Request:
    """The typed request, or FrameError with the error reply's code and message.
    Checked in order: the session id, the type, then the type's fields in the order
    protocol.md lists them."""
    if not isinstance(message, dict):
        raise FrameError(wire.BAD_FRAME, "a frame must be a map with a string 'type'")
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
    model, adapter = m.get("model"), m.get("adapter")
    if adapter is not None and not isinstance(adapter, dict):
        raise FrameError(wire.BAD_ADAPTER, "'adapter' is a map of digest, spec and tensors")
    return OpenRequest(session, model if isinstance(model, str) else None, _int(m, "start"), _int(m, "end"),
                       _int(m, "max_tokens"), adapter)


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
        if (not isinstance(chunks, list) or not chunks or not all(is_int(c) and c >= 1 for c in chunks)
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


_REQUESTS: dict[str, Callable[[dict, bytes], Request]] = {"open": _open, "step": _step, "push": _push, "link": _link, "truncate": _truncate,
             "receipt": _receipt, "close": _close}


# ---------------------------------------------------------------- replies


@dataclasses.dataclass(frozen=True)
class Opened:
    session: bytes
    free_tokens: int
    format: str = ""  # the weight format the span computes in ("fp32", "q4/g64", ...); "" = unsaid
    adapter: bytes | None = None  # the digest of the adapter the session applies (None: none)

    def to_wire(self) -> dict:
        return {"type": "opened", "session": self.session, "free_tokens": self.free_tokens} | (
            {"format": self.format} if self.format else {}) | (
            {"adapter": self.adapter} if self.adapter is not None else {})


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


Reply = Opened | Result | Linked | Truncated | Receipted | Closed | ErrorReply

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
        position = request.position if isinstance(request, StepRequest) else None  # a result names its step
        if kind != answer or (position is not None and message.get("position") != position):
            raise PeerMisbehaved(f"answered {name} {position} with {kind}" if position is not None
                                 else f"answered {name} with {kind}")
    decode = _REPLIES.get(kind)
    if decode is None:
        raise PeerMisbehaved(f"unknown reply type {kind!r}")
    session = message.get("session")
    if not isinstance(session, bytes) or len(session) != SESSION_ID_BYTES:
        raise PeerMisbehaved(f"a reply's 'session' must be {SESSION_ID_BYTES} bytes")
    reply = decode(message, session)
    if isinstance(request, StepRequest) and isinstance(reply, Result) and reply.hidden.tokens != request.reply_tokens:
        raise PeerMisbehaved(f"returned {reply.hidden.tokens} tokens for {request.reply_tokens}")
    return reply


def _reply_int(message: dict, name: str) -> int:
    value = message.get(name)
    if not is_int(value) or value < 0:
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
    adapter = m.get("adapter")
    if adapter is not None and not (isinstance(adapter, bytes) and len(adapter) == ADAPTER_DIGEST_BYTES):
        raise PeerMisbehaved(f"a reply's 'adapter' must be a digest of {ADAPTER_DIGEST_BYTES} bytes")
    return Opened(session, _reply_int(m, "free_tokens"), fmt, adapter)


_REPLIES: dict[str, Callable[[dict, bytes], Reply]] = {"opened": _opened, "result": _result,
            "linked": lambda m, s: Linked(s), "truncated": lambda m, s: Truncated(s, _reply_int(m, "position")),
            "receipted": _receipted, "closed": lambda m, s: Closed(s)}


# ---------------------------------------------------------------- fields


def _int(message: dict, name: str) -> int:
    value = message.get(name)
    if not is_int(value) or value < 0:
        raise FrameError(BAD_REQUEST, f"{name!r} must be a non-negative integer")
    return value
