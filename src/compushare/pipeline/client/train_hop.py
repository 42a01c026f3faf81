"""One training session on one server's span, over /compushare/train: the consumer's I/O.

A stream per hop; requests go one at a time on it (a second microbatch for the same
hop waits for the stream: the server computes one of a peer's requests at a time
anyway). The adapter is named by digest and its tensors sent only when this server
has not seen that digest (an `unknown_adapter` answer: sent again). Deadlines
follow the hop's measured seconds per token, so a hung or very slow server is
given up in a bounded time and its span re-run elsewhere. Every failure is a
HopFailed naming the server.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time

import torch
import trio
from libp2p.abc import IHost
from libp2p.network.stream.exceptions import StreamError

from ... import wire
from ...errors import BAD_REPLY, CLOSED, CONNECTION_LOST, TIMEOUT, FrameError, HopFailed, PeerMisbehaved, UsageError
from ...karma.receipts import Receipt, parse_receipt, sign_receipt
from ...model.lora import Adapter
from ...net.codec import DEFAULT_MAX_FRAME
from ...net.dial import dial
from ...net.framing import FramedStream
from ...net.tensors import encode_tensor
from ...proofs.training import INPUT_PART, OUTPUT_PART, TrainStatement, train_input_digest, train_output_digest
from .. import protocol
from ..adapter_wire import adapter_to_wire
from ..message_parts import WireTensor
from ..train_messages import (
    BackwardResult, ForwardResult, TrainBackward, TrainError, TrainForward, TrainOpen, TrainOpened, TrainReceipt,
    TrainReceipted, TrainRequest, decode_reply,
)
from .routing import Hop

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
FRAME_HEADROOM = 64 * 1024  # a request's fields and names beside its tensors' bytes
FIRST_DEADLINE_S = 120.0  # before anything is measured: a first backward on a slow CPU
DEADLINE_FACTOR = 4.0  # a request may take this many times its predicted time...
MIN_DEADLINE_S = 5.0  # ... and at least this much more
EWMA = 0.3
RECEIPT_EVERY = 16  # requests between receipts (karma)


@dataclasses.dataclass(frozen=True)
class Answer:
    """A forward's or backward's answer, and what the server signed of it (a spot
    check compares two and, on a mismatch, reports them)."""

    tensor: torch.Tensor  # the span's output (forward) or its input's gradient (backward)
    grads: dict[str, torch.Tensor]  # each adapter tensor's gradient (backward; empty for a forward)
    parts: list[tuple[str, bytes]]  # as signed: ("output", ...) or ("input", ...) then each adapter tensor's
    signature: bytes
    input_digest: bytes
    compute_ms: float
    peer_id: str  # who answered, for which blocks, in which compute mode
    start: int
    end: int
    mode: str


def wire_tensor(tensor: torch.Tensor) -> WireTensor:
    encoded = encode_tensor(tensor.detach().float().contiguous())
    return WireTensor(encoded["dtype"], tuple(encoded["shape"]), encoded["data"])


def _tensor(value: WireTensor, shape: tuple[int, ...], where: str) -> torch.Tensor:
    if value.dtype != "float32" or tuple(value.shape) != tuple(shape) or len(value.data) != 4 * math.prod(shape):
        raise PeerMisbehaved(f"{where}: expected float32 {list(shape)}, got {value.dtype} {list(value.shape)}")
    out = torch.frombuffer(bytearray(value.data), dtype=torch.float32).reshape(shape)
    if not torch.isfinite(out).all():
        raise PeerMisbehaved(f"{where}: holds NaN or infinity")
    return out


def _digest(adapter: Adapter | None) -> bytes:
    return adapter.digest() if adapter is not None else b""



class TrainHop:
    def __init__(self, host: IHost, hop: Hop, model_id: str) -> None:
        self.host, self.hop, self.model_id = host, hop, model_id
        self.session = os.urandom(protocol.SESSION_ID_BYTES)
        self.framed: FramedStream | None = None
        self.format = ""
        self.lock = trio.Lock()
        self._ids = 0
        self._held: bytes = b""  # the adapter digest this server holds for us
        self.seconds_per_token = {"forward": 0.0, "backward": 0.0}
        self.requests = 0
        self.usage_tokens, self.usage_ms, self.wall_ms, self.receipt_seq = 0, 0.0, 0.0, 0
        self.receipts: list[Receipt] = []

    @property
    def peer_id(self) -> str:
        return self.hop.peer_id

    @property
    def start(self) -> int:
        return self.hop.start

    @property
    def end(self) -> int:
        return self.hop.end

    def _where(self) -> str:
        return f"{self.peer_id} (blocks {self.start}:{self.end})"

    async def open(self) -> None:
        try:
            with trio.fail_after(CONNECT_TIMEOUT_S):
                info = await dial(self.host, self.peer_id, self.hop.record.addrs, timeout=CONNECT_TIMEOUT_S)
                stream = await self.host.new_stream(info.peer_id, [wire.TRAIN])
        except trio.TooSlowError:
            raise HopFailed(self.peer_id, TIMEOUT, f"could not reach {self._where()}") from None
        except Exception as exc:
            raise HopFailed(self.peer_id, CONNECTION_LOST, f"could not open a stream to {self._where()}: {exc}") \
                from None
        self.framed = FramedStream(stream, DEFAULT_MAX_FRAME)
        opened = await self._request(TrainOpen(self._next(), self.session, self.model_id, self.start, self.end),
                                     CONNECT_TIMEOUT_S)
        assert isinstance(opened, TrainOpened)
        self.format = opened.format

    async def close(self) -> None:
        if self.framed is not None:
            try:
                with trio.move_on_after(1.0):
                    await self.framed.close()
            except Exception:  # closing a broken stream: nothing left to do
                pass

    def _next(self) -> int:
        self._ids += 1
        return self._ids

    def deadline(self, kind: str, tokens: int) -> float:
        rate = self.seconds_per_token[kind]
        return FIRST_DEADLINE_S if rate <= 0 else MIN_DEADLINE_S + DEADLINE_FACTOR * rate * tokens

    async def _request(self, message: TrainRequest, timeout: float):
        assert self.framed is not None, "open() first"
        try:
            with trio.fail_after(timeout):
                while True:
                    await self.framed.send(message.to_wire())
                    raw = await self.framed.receive()
                    if raw is None:
                        raise HopFailed(self.peer_id, CLOSED, f"{self._where()} closed the stream")
                    reply = decode_reply(raw, message)
                    if isinstance(reply, TrainError) and reply.code == protocol.RATE_LIMITED:
                        await trio.sleep(min(reply.retry_after_s or 0.1, 5.0))
                        continue
                    break
        except trio.TooSlowError:
            raise HopFailed(self.peer_id, TIMEOUT, f"{self._where()} did not answer within {timeout:.1f}s") from None
        except (StreamError, FrameError) as exc:
            raise HopFailed(self.peer_id, CONNECTION_LOST, f"lost the stream to {self._where()}: "
                                                           f"{str(exc) or type(exc).__name__}") from None
        except PeerMisbehaved as exc:
            raise HopFailed(self.peer_id, BAD_REPLY, f"{self._where()}: {exc}") from None
        if isinstance(reply, TrainError):
            raise HopFailed(self.peer_id, reply.code, f"{self._where()}: {reply.message}")
        return reply

    async def _compute(self, kind: str, build, tokens: int, adapter: Adapter | None, payload: int):
        """Send a forward or backward (`payload`: its tensors' bytes), with the adapter's
        tensors only if this server lacks them (sent again after an `unknown_adapter`:
        it may have dropped them)."""
        async with self.lock:
            for attempt in range(2):
                digest = adapter.digest() if adapter is not None else b""
                with_tensors = adapter is not None and (self._held != digest or attempt > 0)
                if with_tensors and adapter.nbytes + payload > DEFAULT_MAX_FRAME - FRAME_HEADROOM:
                    raise UsageError(
                        f"the adapter's factors for blocks {self.start}:{self.end} ({adapter.nbytes / 2**20:.1f} MiB) "
                        f"and the microbatch ({payload / 2**20:.1f} MiB) exceed a frame's "
                        f"{DEFAULT_MAX_FRAME >> 20} MiB: adapt fewer projections or use a lower rank")
                shipped = None if adapter is None else adapter_to_wire(adapter, with_tensors=with_tensors)
                began = time.perf_counter()
                try:
                    reply = await self._request(build(self._next(), shipped), self.deadline(kind, tokens))
                except HopFailed as exc:
                    if exc.code == wire.UNKNOWN_ADAPTER and attempt == 0:
                        self._held = b""
                        continue
                    raise
                wall = time.perf_counter() - began
                self._held = digest
                rate = wall / tokens
                old = self.seconds_per_token[kind]
                self.seconds_per_token[kind] = rate if old <= 0 else (1 - EWMA) * old + EWMA * rate
                self.requests += 1
                self.usage_tokens += tokens
                self.usage_ms += min(reply.compute_ms, wall * 1000)
                self.wall_ms += wall * 1000
                return reply
        raise AssertionError("unreachable")  # pragma: no cover

    async def forward(self, hidden: torch.Tensor, adapter: Adapter | None) -> Answer:
        sent = wire_tensor(hidden)
        reply = await self._compute("forward", lambda i, a: TrainForward(i, self.session, sent, a),
                                    hidden.shape[0] * hidden.shape[1], adapter, len(sent.data))
        assert isinstance(reply, ForwardResult)
        try:
            output = _tensor(reply.hidden, tuple(hidden.shape), "forward output")
        except PeerMisbehaved as exc:
            raise HopFailed(self.peer_id, BAD_REPLY, f"{self._where()}: {exc}") from None
        return self._signed(output, {}, [(OUTPUT_PART, reply.hidden.data)], reply.signature, reply.compute_ms,
                            train_input_digest(sent.data, b"", _digest(adapter)))

    async def backward(self, hidden: torch.Tensor, grad_output: torch.Tensor, adapter: Adapter | None) -> Answer:
        sent, grad = wire_tensor(hidden), wire_tensor(grad_output)
        reply = await self._compute("backward", lambda i, a: TrainBackward(i, self.session, sent, grad, a),
                                    hidden.shape[0] * hidden.shape[1], adapter, len(sent.data) + len(grad.data))
        assert isinstance(reply, BackwardResult)
        expected = {} if adapter is None else {name: tuple(t.shape) for name, t in adapter.tensors.items()}
        try:  # each gradient of the shape it must have
            if set(reply.grads) != set(expected):
                raise PeerMisbehaved("its gradients are not for the adapter's tensors sent")
            grad_input = _tensor(reply.grad, tuple(sent.shape), "input gradient")
            grads = {name: _tensor(reply.grads[name], expected[name], name) for name in sorted(expected)}
        except PeerMisbehaved as exc:
            raise HopFailed(self.peer_id, BAD_REPLY, f"{self._where()}: {exc}") from None
        parts = [(INPUT_PART, reply.grad.data)] + [(name, reply.grads[name].data) for name in sorted(expected)]
        return self._signed(grad_input, grads, parts, reply.signature, reply.compute_ms,
                            train_input_digest(sent.data, grad.data, _digest(adapter)))

    def _signed(self, tensor, grads, parts, signature: bytes, compute_ms: float, digest_in: bytes) -> Answer:
        """The answer, if signed by this server over exactly these parts (what a failure
        report would rest on)."""
        statement = TrainStatement(self.format, self.model_id, self.start, self.end, digest_in,
                                   train_output_digest(parts))
        if not statement.verify(self.peer_id, signature):
            raise HopFailed(self.peer_id, BAD_REPLY, f"{self._where()}: its answer is not signed by it")
        return Answer(tensor, grads, parts, signature, digest_in, compute_ms, self.peer_id, self.start, self.end,
                      self.format)

    async def receipt(self) -> Receipt | None:
        """Karma: a receipt for the requests since the last one, countersigned by the
        server (None: nothing to receipt, or the server keeps no ledger)."""
        if self.usage_tokens == 0:
            return None
        receipt = Receipt(server=self.peer_id, consumer=self.host.get_id().to_string(), model_id=self.model_id,
                          start=self.start, end=self.end, session=self.session, seq=self.receipt_seq,
                          tokens=self.usage_tokens, compute_ms=self.usage_ms,
                          wall_ms=max(self.wall_ms, self.usage_ms), time=time.time())
        signed = sign_receipt(receipt, self.host.get_private_key())
        async with self.lock:
            try:
                reply = await self._request(TrainReceipt(self._next(), self.session, signed), MIN_DEADLINE_S)
            except HopFailed as exc:  # refused, or no answer: the server's books did not move, nor do ours
                log.info("%s did not countersign a training receipt: %s", self._where(), exc)
                return None
        assert isinstance(reply, TrainReceipted)
        try:
            kept = parse_receipt(reply.receipt)
        except PeerMisbehaved:
            return None
        self.receipt_seq += 1
        self.usage_tokens, self.usage_ms, self.wall_ms = 0, 0.0, 0.0
        self.receipts.append(kept)
        return kept


async def open_train_hop(host: IHost, hop: Hop, model_id: str) -> TrainHop:
    remote = TrainHop(host, hop, model_id)
    try:
        await remote.open()
    except BaseException:
        await remote.close()
        raise
    return remote
