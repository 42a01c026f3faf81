"""The messages of /compushare/train/1.0.0, typed. Pure: no I/O, no torch, no libp2p.

A consumer opens a training session on a server's span, then sends microbatches:
`forward` (the span's output for a hidden state [B, T, H]) and `backward` (the
span's input gradient and its adapter's gradients, for that input and the output's
gradient; the server recomputes the forward). Every request carries an `id` its
reply echoes. `decode_request` is the only reader of requests and `decode_reply`
of replies; tensors stay WireTensors until the server, knowing its hidden size and
limits, builds them. protocol.md has the maps.
"""

from __future__ import annotations

import dataclasses

from .. import wire
from ..errors import FrameError, PeerMisbehaved
from ..karma.receipts import MAX_RECEIPT_BYTES
from .message_parts import WireTensor, is_int
from .protocol import BAD_REQUEST, SESSION_ID_BYTES

MAX_REQUEST_ID = 2**53
MAX_GRADS = 4096  # adapter tensors in one backward reply
SIGNATURE_BYTES = 64  # Ed25519


@dataclasses.dataclass(frozen=True)
class TrainOpen:
    id: int
    session: bytes
    model: str | None
    start: int
    end: int

    def to_wire(self) -> dict:
        return {"type": "open", "id": self.id, "session": self.session, "model": self.model, "start": self.start,
                "end": self.end}


@dataclasses.dataclass(frozen=True)
class TrainForward:
    id: int
    session: bytes
    hidden: WireTensor
    adapter: dict | None  # adapter_wire's map, checked where the span is known

    def to_wire(self) -> dict:
        out = {"type": "forward", "id": self.id, "session": self.session, "hidden": self.hidden.to_wire()}
        if self.adapter is not None:
            out["adapter"] = self.adapter
        return out


@dataclasses.dataclass(frozen=True)
class TrainBackward:
    id: int
    session: bytes
    hidden: WireTensor
    grad: WireTensor  # d loss / d the span's output
    adapter: dict | None

    def to_wire(self) -> dict:
        out = {"type": "backward", "id": self.id, "session": self.session, "hidden": self.hidden.to_wire(),
               "grad": self.grad.to_wire()}
        if self.adapter is not None:
            out["adapter"] = self.adapter
        return out


@dataclasses.dataclass(frozen=True)
class TrainReceipt:
    id: int
    session: bytes
    receipt: bytes  # karma.receipts: the consumer's half

    def to_wire(self) -> dict:
        return {"type": "receipt", "id": self.id, "session": self.session, "receipt": self.receipt}


TrainRequest = TrainOpen | TrainForward | TrainBackward | TrainReceipt


def _int(m: dict, key: str) -> int:
    value = m.get(key)
    if not is_int(value):
        raise FrameError(BAD_REQUEST, f"{key!r} must be an integer")
    return value


def _adapter(m: dict) -> dict | None:
    value = m.get("adapter")
    if value is not None and not isinstance(value, dict):
        raise FrameError(wire.BAD_ADAPTER, "'adapter' must be a map")
    return value


def decode_request(message: object) -> TrainRequest:
    """The typed request, or FrameError with the error reply's code and message."""
    if not isinstance(message, dict):
        raise FrameError(wire.BAD_FRAME, "a frame must be a map with a string 'type'")
    request_id = message.get("id")
    if not is_int(request_id) or not 0 <= request_id < MAX_REQUEST_ID:
        raise FrameError(BAD_REQUEST, "'id' must be a non-negative integer")
    session = message.get("session")
    if not isinstance(session, bytes) or len(session) != SESSION_ID_BYTES:
        raise FrameError(BAD_REQUEST, f"'session' must be {SESSION_ID_BYTES} bytes")
    kind = message.get("type")
    if kind == "open":
        model = message.get("model")
        return TrainOpen(request_id, session, model if isinstance(model, str) else None, _int(message, "start"),
                         _int(message, "end"))
    if kind == "forward":
        return TrainForward(request_id, session, WireTensor.from_wire(message.get("hidden")), _adapter(message))
    if kind == "backward":
        return TrainBackward(request_id, session, WireTensor.from_wire(message.get("hidden")),
                             WireTensor.from_wire(message.get("grad")), _adapter(message))
    if kind == "receipt":
        receipt = message.get("receipt")
        if not isinstance(receipt, bytes) or len(receipt) > MAX_RECEIPT_BYTES:
            raise FrameError(wire.BAD_RECEIPT, f"'receipt' must be at most {MAX_RECEIPT_BYTES} bytes")
        return TrainReceipt(request_id, session, receipt)
    raise FrameError(BAD_REQUEST, f"unknown message type {kind!r}")


def request_id_of(message: object) -> int | None:
    value = message.get("id") if isinstance(message, dict) else None
    return value if is_int(value) else None


# ---------------------------------------------------------------- replies


@dataclasses.dataclass(frozen=True)
class TrainOpened:
    id: int
    format: str  # the span's weight format: its gradients' tolerance in spot checks

    def to_wire(self) -> dict:
        return {"type": "opened", "id": self.id, "format": self.format}


@dataclasses.dataclass(frozen=True)
class ForwardResult:
    id: int
    hidden: WireTensor
    compute_ms: float
    signature: bytes  # the server's over proofs.training.TrainStatement

    def to_wire(self) -> dict:
        return {"type": "output", "id": self.id, "hidden": self.hidden.to_wire(), "compute_ms": self.compute_ms,
                "sig": self.signature}


@dataclasses.dataclass(frozen=True)
class BackwardResult:
    id: int
    grad: WireTensor  # d loss / d the span's input
    grads: dict[str, WireTensor]  # d loss / d each adapter tensor sent
    compute_ms: float
    signature: bytes  # the server's over proofs.training.TrainStatement: what a failure report rests on

    def to_wire(self) -> dict:
        return {"type": "grads", "id": self.id, "grad": self.grad.to_wire(),
                "grads": {name: t.to_wire() for name, t in self.grads.items()}, "compute_ms": self.compute_ms,
                "sig": self.signature}


@dataclasses.dataclass(frozen=True)
class TrainReceipted:
    id: int
    receipt: bytes

    def to_wire(self) -> dict:
        return {"type": "receipted", "id": self.id, "receipt": self.receipt}


@dataclasses.dataclass(frozen=True)
class TrainError:
    id: int | None
    code: str
    message: str
    retry_after_s: float | None = None

    def to_wire(self) -> dict:
        out: dict[str, object] = {"type": "error", "id": self.id, "code": self.code, "message": self.message}
        if self.retry_after_s is not None:
            out["retry_after_s"] = self.retry_after_s
        return out


TrainReply = TrainOpened | ForwardResult | BackwardResult | TrainReceipted | TrainError
_EXPECTED = {TrainOpen: TrainOpened, TrainForward: ForwardResult, TrainBackward: BackwardResult,
             TrainReceipt: TrainReceipted}


def _ms(m: dict) -> float:
    value = m.get("compute_ms")
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value < 1e9:
        raise PeerMisbehaved("'compute_ms' must be a non-negative number")
    return float(value)


def _signature(m: dict) -> bytes:
    signature = m.get("sig")
    if not isinstance(signature, bytes) or len(signature) != SIGNATURE_BYTES:
        raise PeerMisbehaved("'sig' must be a 64-byte signature")
    return signature


def decode_reply(message: object, request: TrainRequest) -> TrainReply:
    """The reply to `request`, checked (PeerMisbehaved otherwise). Tensor contents are
    checked where they are built (their shapes are the request's)."""
    if not isinstance(message, dict) or message.get("id") != request.id:
        raise PeerMisbehaved("a reply must be a map echoing its request's id")
    kind = message.get("type")
    try:
        if kind == "error":
            code, text = message.get("code"), message.get("message")
            retry = message.get("retry_after_s")
            if not isinstance(code, str) or not isinstance(text, str):
                raise PeerMisbehaved("an error reply has a string code and message")
            return TrainError(request.id, code, text[:1000], float(retry) if isinstance(retry, int | float) else None)
        expected = _EXPECTED[type(request)]
        if kind == "opened" and expected is TrainOpened and isinstance(message.get("format"), str):
            return TrainOpened(request.id, message["format"][:16])
        if kind == "output" and expected is ForwardResult:
            return ForwardResult(request.id, WireTensor.from_wire(message.get("hidden")), _ms(message),
                                 _signature(message))
        if kind == "grads" and expected is BackwardResult:
            grads, signature = message.get("grads"), _signature(message)
            if not isinstance(grads, dict) or len(grads) > MAX_GRADS or not all(isinstance(k, str) for k in grads):
                raise PeerMisbehaved("'grads' must be a map of names to tensors")
            return BackwardResult(request.id, WireTensor.from_wire(message.get("grad")),
                                  {k: WireTensor.from_wire(v, dims=2) for k, v in grads.items()}, _ms(message),
                                  signature)
        if kind == "receipted" and expected is TrainReceipted and isinstance(message.get("receipt"), bytes):
            return TrainReceipted(request.id, message["receipt"])
    except FrameError as exc:
        raise PeerMisbehaved(f"malformed {kind} reply: {exc.message}") from None
    raise PeerMisbehaved(f"a {kind!r} reply does not answer a {type(request).__name__}")
