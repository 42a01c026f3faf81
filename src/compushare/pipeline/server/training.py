"""The provider's side of /compushare/train/1.0.0: stateless forward and backward of
a microbatch over the span it serves, for consumers training their own adapters.

A thin trio driver beside the inference server, sharing its span, its compute (the
same fair scheduler: a training request is one long piece of its peer's, and any
decode step preempts it between two layers), its per-peer rate limits and its karma
ledger. Nothing is kept between requests but each training session's books (owner,
span, tokens not yet receipted) and the adapters peers sent (AdapterCache). The
memory a request's activations take while its backward runs is bounded: estimated
from its tokens and the span's shapes, refused outright beyond the node's training
budget (`too_long`), and waited for while other requests hold it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

import torch
import trio

from ...errors import FrameError, PeerMisbehaved
from ...model.kernel_grads import TILE_ROWS, backward_transient_bytes
from ...net.serve import GuardedHandler
from ...net.tensors import decode_tensor
from ...proofs.training import INPUT_PART, OUTPUT_PART, TrainStatement, train_input_digest, train_output_digest
from .. import protocol
from ..adapter_wire import AdapterCache, decode_adapter
from ..message_parts import WireTensor
from ..train_messages import (
    BackwardResult, ForwardResult, TrainBackward, TrainError, TrainForward, TrainOpen, TrainOpened, TrainReceipt,
    TrainReceipted, decode_request, request_id_of,
)
from .compute import wire
from .receipts import check_receipt
from .session import Rejected
from .streams import refuse_stream, serve_stream

log = logging.getLogger(__name__)

MAX_SESSIONS_PER_PEER = 8
MAX_SESSIONS = 256
MAX_BATCH = 64  # sequences in one microbatch
SESSION_IDLE_S = 600.0
BACKWARD_COST = 3  # a backward recomputes the forward, then runs the backward: about 3 forwards
BUDGET_WAIT_S = 30.0
TRAINABLE_RUNTIMES = ("torch", "ggml")  # ggml: each layer on torch from the same file (model/span_training.py)


def _tiles_bytes(runner) -> int:
    """What a backward holds beyond its activations: a dequantized tile of rows, and on
    a span without a backward of its own (ggml) one layer's torch copy (counted once per
    runner: a move makes a new one)."""
    if not hasattr(runner, "tiles_bytes"):
        if runner.runtime != "torch":  # a layer repacked for torch: about its stored bytes, and its tile
            layer = runner.weight_bytes // (runner.end - runner.start)
            runner.tiles_bytes = layer + 4 * TILE_ROWS * getattr(runner.config, "intermediate_size", 0) * 2
        else:
            runner.tiles_bytes = backward_transient_bytes(runner.layers.values())
    return runner.tiles_bytes


def activation_bytes(config, tokens: int, seq_len: int, blocks: int) -> int:
    """What a backward over `blocks` layers of `tokens` tokens (sequences of `seq_len`)
    holds at its peak, float32: per token and layer, the tensors autograd keeps (the
    norms' inputs and outputs, q, k, v, the attention's output, the MLP's gate, up,
    their product and input: about 10 hidden-sized and 6 intermediate-sized rows) and
    a row of attention probabilities per head."""
    per_token = 10 * config.hidden_size + 6 * config.intermediate_size + config.num_attention_heads * seq_len
    return 4 * tokens * blocks * per_token


@dataclasses.dataclass
class TrainingSession:
    """A consumer's training on this span: its books for receipts (the fields
    receipts.check_receipt reads of an inference session)."""

    session_id: bytes
    owner: str
    start: int
    end: int
    last_used: float
    receipt_seq: int = 0
    unreceipted_tokens: int = 0
    unreceipted_ms: float = 0.0

    def receipted(self) -> None:
        self.receipt_seq += 1
        self.unreceipted_tokens, self.unreceipted_ms = 0, 0.0


class MemoryBudget:
    """Bytes of training activations held at once, all requests together."""

    def __init__(self, total: int) -> None:
        self.total, self.used = total, 0
        self._changed = trio.Event()

    async def hold(self, nbytes: int, timeout: float):
        if nbytes > self.total:
            raise Rejected(protocol.TOO_LONG, f"the microbatch needs ~{nbytes >> 20} MiB of activations; this "
                                              f"server's training budget is {self.total >> 20} MiB: send fewer tokens")
        with trio.move_on_after(timeout):
            while self.used + nbytes > self.total:
                await self._changed.wait()
        if self.used + nbytes > self.total:
            raise Rejected(protocol.BUSY, "this server's training memory is taken; retry later")
        self.used += nbytes
        return _Held(self, nbytes)

    def release(self, nbytes: int) -> None:
        self.used -= nbytes
        self._changed.set()
        self._changed = trio.Event()


@dataclasses.dataclass
class _Held:
    budget: MemoryBudget
    nbytes: int

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.budget.release(self.nbytes)


class TrainingServer:
    def __init__(self, server, *, memory_bytes: int, adapters: AdapterCache | None = None) -> None:
        """`server`: the node's InferenceServer (its span, compute, limits, keys, ledger)."""
        self.server = server
        self.sessions: dict[bytes, TrainingSession] = {}
        self.adapters = adapters or AdapterCache()
        self.memory = MemoryBudget(memory_bytes)
        self._twins_runner, self._twins_reserved = None, 0  # a ggml span's kept torch twins: whose, how much
        self.requests = 0  # forwards and backwards answered
        limits = server.limits
        # A consumer's stream to one stage waits, between a microbatch's forward and its
        # backward, for every later stage: minutes on a big model. It may idle as long
        # as a session may (the per-peer stream cap bounds what is parked).
        self.rpc_train = GuardedHandler(functools.partial(serve_stream, handle=self.handle, limits=limits,
                                                          idle_timeout_s=SESSION_IDLE_S),
                                        per_peer=limits.max_streams_per_peer,
                                        refuse=functools.partial(refuse_stream, limits=limits))

    async def handle(self, message: dict, peer: str = "", nbytes: int = 0, opened: set[bytes] | None = None) -> dict:
        request_id = request_id_of(message)
        wait = self.server.rate_limiter.check(peer, nbytes, time.monotonic())
        if wait:
            return TrainError(request_id, protocol.RATE_LIMITED, f"too many requests or bytes from this peer; retry "
                                                                 f"in {wait:.2f} s", wait).to_wire()
        try:
            request = decode_request(message)
            match request:
                case TrainOpen():
                    return self._open(request, peer).to_wire()
                case TrainForward() | TrainBackward():
                    return (await self._compute(request, peer)).to_wire()
                case TrainReceipt():
                    return (await self._receipt(request, peer)).to_wire()
        except (Rejected, FrameError) as exc:
            return TrainError(request_id, exc.code, exc.message).to_wire()
        raise AssertionError("decode_request returned an unknown request")  # pragma: no cover

    def _open(self, request: TrainOpen, peer: str) -> TrainOpened:
        server, runner = self.server, self.server.runner
        if server.moving or server.paused:
            raise Rejected(protocol.BUSY, "this server is moving to other blocks or paused by its user")
        if request.model != server.model_id:
            raise Rejected(protocol.WRONG_MODEL, f"this server serves model {server.model_id}")
        if not (runner.start <= request.start < request.end <= runner.end):
            raise Rejected(protocol.BAD_SPAN, f"{request.start}:{request.end} is not within {runner.start}:{runner.end}")
        if runner.runtime not in TRAINABLE_RUNTIMES:
            raise Rejected(protocol.BAD_REQUEST, f"this span computes on {runner.runtime}; training goes through "
                                                 f"spans on {' or '.join(TRAINABLE_RUNTIMES)} only")
        self._expire(time.monotonic())
        if request.session in self.sessions:
            raise Rejected(protocol.SESSION_EXISTS, "a training session with this id is open")
        if sum(s.owner == peer for s in self.sessions.values()) >= MAX_SESSIONS_PER_PEER or \
                len(self.sessions) >= MAX_SESSIONS:
            raise Rejected(protocol.BUSY, "too many training sessions open")
        self.sessions[request.session] = TrainingSession(request.session, peer, request.start, request.end,
                                                         time.monotonic())
        return TrainOpened(request.id, runner.format_label)

    def _session(self, session_id: bytes, peer: str) -> TrainingSession:
        session = self.sessions.get(session_id)
        if session is None or session.owner != peer:
            raise Rejected(protocol.UNKNOWN_SESSION, "no training session with this id is open for this peer")
        session.last_used = time.monotonic()
        return session

    def _expire(self, now: float) -> None:
        for sid in [sid for sid, s in self.sessions.items() if now - s.last_used > SESSION_IDLE_S]:
            del self.sessions[sid]

    def _tensor(self, value: WireTensor, runner) -> torch.Tensor:
        return decode_tensor(value.to_wire(), hidden_size=runner.hidden_size,
                             max_tokens=self.server.limits.max_step_tokens, max_batch=MAX_BATCH).float()

    async def _compute(self, request: TrainForward | TrainBackward, peer: str) -> ForwardResult | BackwardResult:
        runner = self.server.runner  # a move swaps it: this request finishes on its own
        session = self._session(request.session, peer)
        start, end = session.start, session.end
        if not (runner.start <= start < end <= runner.end):
            raise Rejected(protocol.BAD_SPAN, "this server no longer serves the session's span")
        hidden = self._tensor(request.hidden, runner)
        backward = isinstance(request, TrainBackward)
        grad = self._tensor(request.grad, runner) if backward else None
        if grad is not None and grad.shape != hidden.shape:
            raise Rejected(protocol.BAD_REQUEST, f"'grad' {list(grad.shape)} must have the shape of 'hidden' "
                                                 f"{list(hidden.shape)}")
        adapter = None if request.adapter is None else decode_adapter(request.adapter, runner.config, start, end,
                                                                      self.adapters, peer)
        rows, tokens = hidden.shape[0], hidden.shape[0] * hidden.shape[1]
        blocks = end - start
        # A backward holds its activations and, through a quantized span, a tile of dequantized rows.
        needed = activation_bytes(runner.config, tokens, hidden.shape[1], blocks) + _tiles_bytes(runner) \
            if backward else 0
        self._keep_twins(runner)
        with await self.memory.hold(needed, BUDGET_WAIT_S):
            if backward:
                compute = functools.partial(_backward, runner, hidden, grad, adapter, start, end)
            else:
                compute = functools.partial(_forward, runner, hidden, adapter, start, end)
            out, seconds = await self.server.compute.run_training(peer, tokens * (BACKWARD_COST if backward else 1),
                                                                  blocks, compute)
        self.requests += 1
        session.unreceipted_tokens += tokens
        session.unreceipted_ms += seconds * 1000
        log.debug("training %s of %d x %d tokens for %s: %.0f ms", "backward" if backward else "forward", rows,
                  hidden.shape[1], peer[-8:], seconds * 1000)
        if backward:
            grad_input, grads = out
            parts = [(INPUT_PART, grad_input)] + [(name, grads[name]) for name in sorted(grads)]
        else:
            parts = [(OUTPUT_PART, out)]
        encoded = [(name, wire(self._noisy(t).float())) for name, t in parts]
        # Signed, as the consumer will digest what it sent: float32 bytes.
        digest_in = train_input_digest(_f32(request.hidden, hidden), _f32(request.grad, grad) if backward else b"",
                                       adapter.digest() if adapter else b"")
        signature = TrainStatement(runner.format_label, self.server.model_id, start, end, digest_in,
                                   train_output_digest([(name, t.data) for name, t in encoded])
                                   ).sign(self.server.key_pair)
        if not backward:
            return ForwardResult(request.id, encoded[0][1], seconds * 1000, signature)
        return BackwardResult(request.id, encoded[0][1], dict(encoded[1:]), seconds * 1000, signature)

    def _keep_twins(self, runner) -> None:
        """A span on ggml trains on torch twins of its layers (model/span_training.py):
        up to half the training budget (and at most twice the span's stored bytes) is
        set aside from it for the twins kept between requests, while `runner` serves."""
        if runner.runtime == "torch" or getattr(runner, "twins", None) is not None:
            return
        from ...model.span_training import LayerTwins  # noqa: PLC0415  (see _forward)

        if self._twins_runner is not None:  # a move: the old span's twins go, their share comes back
            self._twins_runner.twins = None
            self.memory.total += self._twins_reserved
        keep = min(self.memory.total // 2, 2 * runner.weight_bytes)
        self.memory.total -= keep
        runner.twins = LayerTwins(runner, keep)
        self._twins_runner, self._twins_reserved = runner, keep

    def _noisy(self, tensor: torch.Tensor) -> torch.Tensor:
        """Fault injection (a lying server, tests and benchmarks): the inference server's noise."""
        noise = self.server.compute.noise
        if noise <= 0:
            return tensor
        return tensor + torch.randn_like(tensor) * noise * tensor.abs().mean().clamp_min(1e-6)

    async def _receipt(self, request: TrainReceipt, peer: str) -> TrainReceipted:
        karma = self.server.karma
        if karma is None:
            raise Rejected(protocol.BAD_REQUEST, "this server keeps no karma ledger")
        session = self._session(request.session, peer)
        receipt = check_receipt(request.receipt, session, peer=peer, server=karma.peer_id,
                                model_id=self.server.model_id, now=time.time())
        try:
            signed = await karma.accept(request.receipt, receipt)
        except PeerMisbehaved as exc:
            raise Rejected(protocol.BAD_RECEIPT, str(exc)) from None
        except OSError as exc:
            log.error("could not keep a receipt: %s", exc)
            raise Rejected(protocol.INTERNAL, "this server could not store the receipt") from None
        session.receipted()
        return TrainReceipted(request.id, signed)


# Training runs on torch spans only (imported when one runs: the torch runtime's modules
# load transformers, some 110 MB a ggml node never needs).

def _forward(runner, hidden, adapter, start, end, pause):
    from ...model.span_training import span_forward

    return runner.slowed(span_forward, runner, hidden, adapter, start, end, between_layers=pause)


def _backward(runner, hidden, grad, adapter, start, end, pause):
    from ...model.span_training import span_backward

    return runner.slowed(span_backward, runner, hidden, grad, adapter, start, end, between_layers=pause)


def _f32(value: WireTensor, tensor: torch.Tensor) -> bytes:
    return value.data if value.dtype == "float32" else tensor.numpy().tobytes()
