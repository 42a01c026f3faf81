"""The provider: serves a span of blocks over /compushare/infer/1.5.0.

A thin trio driver. One handler task per stream reads frames in order (a stream
may carry several sessions); each frame is rate-limited per peer, decoded once
(messages.py), and handed to the session core (session.py), which checks it
against the session's state and keeps the books; the forward runs where compute.py
puts it; pushes go through pushed.py. Bad input gets an error reply and costs
nothing else: the stream stays usable, except after an oversized frame, whose
remaining bytes cannot be skipped safely.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time

import torch
import trio
from libp2p.crypto.keys import KeyPair

from ... import defences
from ...config import ServerLimits
from ...errors import FrameError, PeerMisbehaved
from ...spans import SpanCompute
from ...net.limits import PeerRateLimiter
from ...net.serve import GuardedHandler
from ...net.tensors import WIRE_DTYPES, decode_tensor
from ...proofs.inference import DEFAULT_MODE, Statement, adapted_model, step_digest
from .. import protocol
from ..messages import (
    CloseRequest, Closed, ErrorReply, Linked, LinkRequest, Opened, OpenRequest, Proof, PushRequest, Receipted,
    ReceiptRequest, Reply, Request, Result, StepRequest, Truncated, TruncateRequest, WireTensor, decode_request,
    echo_session,
)
from .adapters import SessionAdapters
from .compute import Compute, wire
from .push import PushLinks
from .receipts import check_receipt
from .session import RollBack, Rejected, Session, SessionTable, State, Step, UsePushed, Wait
from .pushed import PushedSteps
from .streams import refuse_stream, serve_stream

log = logging.getLogger(__name__)

EXPIRY_PERIOD_S = 1.0
PARK_MAX_TOKENS = 16  # a verify pass's size: what a push may be kept waiting for its rollback (memory)
UPSTREAM_CHECK_S = 0.05  # a step waiting for its push looks this often whether its upstream is still connected


def session_table(limits: ServerLimits) -> SessionTable:
    return SessionTable(
        budget_tokens=limits.kv_budget_tokens, max_session_tokens=limits.max_session_tokens,
        max_step_tokens=limits.max_step_tokens, idle_timeout_s=limits.session_idle_timeout_s,
        max_sessions=limits.max_sessions, max_sessions_per_peer=limits.max_sessions_per_peer,
        fair=not defences.disabled("fair_kv"))


def close_all(table: SessionTable, opened: set[bytes]) -> None:
    """The sessions opened on an infer stream end with it."""
    for session_id in opened:
        if (session := table.close(session_id)) is not None:
            log.info("session %s closed with its stream; freed %d tokens", session_id.hex()[:8], session.max_tokens)


class InferenceServer:
    def __init__(self, runner: SpanCompute, model_id: str, limits: ServerLimits, *, key_pair: KeyPair,
                 block_rate: float = 0.0, noise: float = 0.0, karma=None,
                 slow_steps: tuple[int, int, float] | None = None) -> None:
        self.runner = runner
        self.model_id = model_id
        self.limits = limits
        self.key_pair = key_pair  # signs every step's output
        self.karma = karma  # a karma.ledger.ReceiptBook: countersigns, keeps receipts (None: no ledger)
        self.rate_limiter = PeerRateLimiter(limits.peer_requests_per_s, limits.peer_bytes_per_s)
        self.sessions = session_table(limits)
        self.compute = Compute(limits.compute_threads, block_rate=block_rate, noise=noise,
                               fair=not defences.disabled("fair_compute"))
        self.moving = False  # set while the node loads another span: new sessions would be dropped
        self.paused = False  # its user paused contributing: no new sessions
        self.pushed: PushedSteps | None = None  # set by enable_push: this server pushes and takes pushes
        self.adapters = SessionAdapters()  # sessions' LoRA adapters, and what they may hold (adapters.py)
        self.slow_steps = slow_steps  # fault injection (app/debug.py): (first, count, seconds)
        self.steps_run = 0
        # The stream handler: at most max_streams_per_peer infer streams of one peer at once.
        self.rpc_infer = GuardedHandler(functools.partial(serve_stream, handle=self.handle, limits=limits,
                                                          ended=functools.partial(close_all, self.sessions)),
                                        per_peer=limits.max_streams_per_peer,
                                        refuse=functools.partial(refuse_stream, limits=limits))

    def enable_push(self, host, nursery: trio.Nursery, *, forge: bool = False) -> None:
        """Let consumers link this server's sessions to their neighbours in a chain
        (push.py); pushes and the steps they start run in `nursery`. `forge`: fault
        injection (app/debug.py), pushes differ from the signed outputs."""
        self.pushed = PushedSteps(PushLinks(host, nursery), nursery, forge=forge)

    @property
    def pushes(self) -> PushLinks | None:
        return None if self.pushed is None else self.pushed.links

    def replace_runner(self, runner: SpanCompute) -> int:
        """Serve another span. Open sessions cannot follow (their caches belong to the
        old span): they are dropped, and their next step gets "unknown session"."""
        self.runner = runner
        self.moving = False
        return self.sessions.drop_all()

    # What the node and its ads read.
    block_rate = property(lambda self: self.compute.block_rate)
    tokens_served = property(lambda self: self.sessions.tokens_served)
    steps_served = property(lambda self: self.sessions.steps_served)
    push_hits = property(lambda self: self.sessions.push_hits)  # steps a push started
    push_misses = property(lambda self: self.sessions.push_misses)

    def load(self, now: float | None = None) -> float:
        return self.compute.load(now)

    def throughput(self, now: float | None = None) -> float:
        return self.compute.throughput(now)

    async def expire_loop(self) -> None:
        while True:
            await trio.sleep(min(EXPIRY_PERIOD_S, self.limits.session_idle_timeout_s / 2))
            for session in self.sessions.expire(time.monotonic()):
                log.info("session %s expired after idling; freed %d tokens", session.session_id.hex()[:8],
                         session.max_tokens)

    # -- requests --------------------------------------------------------------------------

    async def handle(self, message: dict, peer: str = "", nbytes: int = 0,
                     opened: set[bytes] | None = None) -> dict | None:
        """The reply to one frame (None: a push that was taken); `opened` collects the
        ids of the sessions it opens (they end with their stream)."""
        wait = self.rate_limiter.check(peer, nbytes, time.monotonic())
        if wait:
            return ErrorReply(protocol.RATE_LIMITED, f"too many requests or bytes from this peer; retry in "
                                                     f"{wait:.2f} s", retry_after_s=wait).to_wire()
        try:
            reply = await self._dispatch(decode_request(message), peer, opened)
        except (Rejected, FrameError) as exc:
            return ErrorReply(exc.code, exc.message, echo_session(message)).to_wire()
        return None if reply is None else reply.to_wire()

    async def _dispatch(self, request: Request, peer: str, opened: set[bytes] | None) -> Reply | None:
        table, runner = self.sessions, self.runner  # a move swaps the runner: a step finishes on its own
        match request:
            case StepRequest():
                return await self._step(request, table, runner)
            case PushRequest():
                return self._push(request, peer, table, runner)
            case LinkRequest(session=sid, upstream=upstream, downstream=downstream):
                table.link(table.get(sid), peer, upstream, downstream, pushes=self.pushed is not None)
                if downstream is not None:
                    self.pushed.links.ensure(downstream)  # dialled in the background
                return Linked(sid)
            case OpenRequest():
                reply = self._open(request, peer, table, runner)
                if opened is not None:
                    opened.add(request.session)
                return reply
            case TruncateRequest(session=sid, position=position):
                await self._rewind(sid, position, table, runner)
                return Truncated(sid, position)
            case ReceiptRequest():
                return await countersign(self.karma, self.model_id, request, peer, table)
            case CloseRequest(session=sid):
                table.close(sid)
                return Closed(sid)
            case _:  # a kind decode_request knows and this match forgot: refused, not left unanswered
                raise Rejected(protocol.BAD_REQUEST, f"this server does not handle {type(request).__name__}")

    def _open(self, request: OpenRequest, peer: str, table: SessionTable, runner: SpanCompute) -> Opened:
        if self.moving or self.paused:
            raise Rejected(protocol.BUSY, "this server is moving to other blocks" if self.moving else
                           "this server's user paused contributing")
        if request.model != self.model_id:
            raise Rejected(protocol.WRONG_MODEL, f"this server serves model {self.model_id}")
        start, end = request.start, request.end
        if not (runner.start <= start < end <= runner.end):
            raise Rejected(protocol.BAD_SPAN, f"{start}:{end} is not within {runner.start}:{runner.end}")
        # Decoded and checked before the session exists: a refused adapter leaves nothing behind.
        held = None if request.adapter is None else self.adapters.admit(request.adapter, runner, start, end, peer)
        session = table.open(request.session, start, end, request.max_tokens, time.monotonic(), owner=peer)
        for lost in table.take_reclaimed():
            log.info("session %s of %s reclaimed for a peer within its fair share; freed %d tokens",
                     lost.session_id.hex()[:8], lost.owner[-8:], lost.max_tokens)
        session.cache = runner.new_cache()
        if held is not None:
            self.adapters.keep(session, held)
        return Opened(request.session, table.free_tokens, runner.format_label, held and held.digest)

    async def _step(self, request: StepRequest, table: SessionTable, runner: SpanCompute) -> Result:
        session = table.get(request.session)  # unknown session before decoding the tensor
        if request.rollback and session.length > request.position:
            session = await self._rewind(request.session, request.position, table, runner)
        if request.from_upstream is not None:
            output, seconds, encoded = await self._from_upstream(request, session, table, runner)
            chunks = [request.tokens]
        else:
            output, seconds, encoded, chunks = await self._own_input(request, session, table, runner)
        position, tokens = request.position, request.tokens
        if request.last_only:
            output = output[:, -chunks[-1]:]
            encoded = wire(output.to(WIRE_DTYPES[encoded.dtype][0]))
        proof = None
        if session.chain is not None:
            proof = prove(self.key_pair, self.model_id, session, position + tokens - chunks[-1], chunks[-1],
                          encoded, output.shape[1], mode=runner.format_label, runtime=runner.build)
        if self.pushed is not None:
            await self.pushed.flushed(session.downstream)  # this step's push goes first
        return Result(request.session, position, encoded, seconds * 1000, proof)

    async def _own_input(self, request: StepRequest, session: Session, table: SessionTable, runner: SpanCompute):
        """A step whose input the consumer sent: computed here, or found computed from
        the upstream's push of the very same bytes."""
        hidden = decode_tensor(request.hidden.to_wire(), hidden_size=runner.hidden_size,
                               max_tokens=self.limits.max_step_tokens)
        position, chunks, data, tokens = request.position, request.sizes, request.hidden.data, hidden.shape[1]
        while isinstance(decision := table.settle(session, position, data, request.hidden.dtype, len(chunks),
                                                  time.monotonic()), Wait):
            await self.pushed.settled(session, decision.step)  # a pushed step ends first
        if isinstance(decision, UsePushed):  # computed (and pushed on) from the upstream server's push
            return decision.step.output, decision.step.seconds, decision.step.encoded, chunks
        if isinstance(decision, RollBack):  # pushed another input: rolled back
            runner.truncate(session.cache, decision.position)
        session = table.begin_step(request.session, position, tokens, time.monotonic())
        output, seconds = await self._run(runner, session, session.step, hidden, chunks)
        encoded = wire(output.to(hidden.dtype))  # reply in the request's dtype
        if len(chunks) == 1 and self.pushed is not None:  # a replay (chunks) is not worth pushing
            # Queued before the reply: the next hop starts before the consumer's copy arrives.
            self.pushed.push_on(session.downstream, position, encoded)
        table.end_step(session, tokens, time.monotonic(), ok=True, seconds=seconds, data=data,
                       dtype=request.hidden.dtype, forwards=tuple(chunks))
        return output, seconds, encoded, chunks

    async def _from_upstream(self, request: StepRequest, session: Session, table: SessionTable,
                             runner: SpanCompute):
        """Direct return: the step's input is what the session's upstream pushes for
        this position. Waits for that push (at most the request's wait_ms, then
        `no_input`, the session unchanged) and answers with the step computed from it;
        the proof signs the pushed bytes as the input, so the consumer can check that
        they are the upstream's signed output."""
        if self.pushed is None:
            raise Rejected(protocol.BAD_REQUEST, "this server does not take pushes")
        position, tokens = request.position, request.tokens
        if position != session.length:
            raise Rejected(protocol.OUT_OF_ORDER, f"step at position {position}, session holds {session.length} tokens")
        if tokens > self.limits.max_step_tokens:
            raise Rejected(protocol.TOO_LONG, f"a step carries 1..{self.limits.max_step_tokens} tokens")
        step = await wait_for_push(self.pushed, request, table, runner)
        return step.output, step.seconds, step.encoded

    async def _rewind(self, session_id: bytes, position: int, table: SessionTable, runner: SpanCompute) -> Session:
        """Cut a session back to `position` tokens (a truncate, or a step's rollback),
        after the pushed step it may hold ends and is discarded."""
        session = table.get(session_id)
        decision = table.discard(session, time.monotonic())
        if isinstance(decision, Wait):  # a pushed step is being computed: it ends first
            await self.pushed.settled(session, decision.step)
            decision = table.discard(session, time.monotonic())
        if isinstance(decision, RollBack):
            runner.truncate(session.cache, decision.position)
        session = table.truncate(session_id, position, time.monotonic())
        runner.truncate(session.cache, position)
        parked, session.parked = session.parked, None
        if parked is not None and parked.position == position:
            with contextlib.suppress(Rejected, FrameError):  # as when it came: only ever a saving
                self._push(parked, session.upstream, table, runner)
        return session

    def _push(self, request: PushRequest, peer: str, table: SessionTable, runner: SpanCompute) -> None:
        """Start computing a step from the upstream server's output; the consumer's own
        step for that position then finds it done (or computing)."""
        if self.pushed is None:
            raise Rejected(protocol.BAD_REQUEST, "this server does not take pushes")
        session = table.get(request.session)
        table.check_pusher(session, peer)
        hidden = decode_tensor(request.hidden.to_wire(), hidden_size=runner.hidden_size,
                               max_tokens=self.limits.max_step_tokens)
        session.pushed_by = peer
        behind = request.position < session.length and session.state is State.READY
        if behind and hidden.shape[1] <= PARK_MAX_TOKENS:
            # Before the consumer's step that rolls the session back to it (speculative
            # decoding dropped drafts; the push can overtake that step): kept until then.
            session.parked = request
            return
        step = table.push(request.session, request.position, hidden.shape[1], request.hidden.data,
                          request.hidden.dtype, time.monotonic())
        self.pushed.start(table, session, step, lambda: self._run(runner, session, step, hidden, [step.tokens]),
                               hidden.dtype)

    async def _run(self, runner: SpanCompute, session: Session, step: Step, hidden: torch.Tensor,
                   chunks: list[int]) -> tuple[torch.Tensor, float]:
        """Compute the session's begun `step`; on failure its cache is rolled back, the
        step failed, and the error propagates."""
        self.steps_run += 1
        try:
            if self.slow_steps is not None and 0 <= self.steps_run - 1 - self.slow_steps[0] < self.slow_steps[1]:
                await trio.sleep(self.slow_steps[2])  # a late step of a node that still answers pings
            return await self.compute.run(runner, session.cache, hidden, step.position, session.start, session.end,
                                          chunks, peer=session.owner, reclaimed=lambda: session.reclaimed,
                                          adapter=None if session.adapter is None else session.adapter.adapter)
        except BaseException:
            runner.truncate(session.cache, step.position)  # a failed forward may have half-appended
            self.sessions.failed(session, step, time.monotonic())
            raise


async def countersign(karma, model_id: str, request: ReceiptRequest, peer: str, table: SessionTable) -> Receipted:
    """Countersign the consumer's receipt for this session's latest steps, if it
    describes them truthfully (receipts.py)."""
    if karma is None:
        raise Rejected(protocol.BAD_REQUEST, "this server keeps no karma ledger")
    session = table.get(request.session)
    receipt = check_receipt(request.receipt, session, peer=peer, server=karma.peer_id,
                            model_id=model_id, now=time.time())
    try:
        signed = await karma.accept(request.receipt, receipt)
    except PeerMisbehaved as exc:  # its slot is taken, or it is too large
        raise Rejected(protocol.BAD_RECEIPT, str(exc)) from None
    except OSError as exc:  # the ledger cannot be written: say so, keep serving
        log.error("could not keep a receipt: %s", exc)
        raise Rejected(protocol.INTERNAL, "this server could not store the receipt") from None
    table.receipted(session)
    return Receipted(request.session, signed)


async def wait_for_push(pushed: PushedSteps, request: StepRequest, table: SessionTable,
                        runner: SpanCompute) -> Step:
    """The pushed step for the request's position, once the session's upstream has
    pushed it; Rejected(NO_INPUT) after the request's wait_ms, or at once when that
    upstream's connection is gone."""
    position, tokens = request.position, request.tokens
    deadline = trio.current_time() + request.from_upstream.wait_ms / 1000
    while True:
        session = table.get(request.session)  # closed meanwhile: unknown_session
        decision = table.take_pushed(session, position, tokens, time.monotonic())
        if isinstance(decision, UsePushed):
            return decision.step
        if isinstance(decision, RollBack):  # a stale push: rolled back, the right one may follow
            runner.truncate(session.cache, decision.position)
        elif isinstance(decision, Wait):
            await pushed.settled(session, decision.step)
        else:
            with trio.move_on_at(min(deadline, trio.current_time() + UPSTREAM_CHECK_S)):
                await pushed.changed()
            # Gone: an upstream that pushed to this session before has no connection
            # now (one not yet connected after a relink may still be dialling).
            gone = session.pushed_by == session.upstream and not pushed.connected(session.upstream)
            if gone or trio.current_time() >= deadline:  # a killed upstream is seen at once
                why = "the upstream server's connection is gone" if gone else \
                    f"no push within {request.from_upstream.wait_ms} ms"
                raise Rejected(protocol.NO_INPUT, f"no input for position {position}: {why}")


def prove(key_pair: KeyPair, model_id: str, session: Session, position: int, tokens: int, encoded: WireTensor,
          returned: int, *, mode: str = DEFAULT_MODE, runtime: str = "") -> Proof:
    """The step proof of the last chunk (positions position..position+tokens-1):
    the last `tokens` of the `returned` token rows `encoded` (proofs/inference.py), computed in
    `mode` (the span's weight format: its tolerance is the protocol's) on `runtime` (its build)."""
    data = encoded.data
    last = memoryview(data)[len(data) - len(data) // returned * tokens:]
    model = adapted_model(model_id, None if session.adapter is None else session.adapter.digest)
    statement = Statement(mode, model, session.start, session.end, position, tokens,
                          session.chain.at(position), session.chain.digest(position, tokens),
                          step_digest(encoded.dtype, last, tokens), runtime, session.chain.forwards(position + tokens))
    return Proof(position, tokens, statement.mode, statement.prefix, statement.input_digest,
                 statement.output_digest, statement.sign(key_pair), statement.runtime, statement.forwards)
