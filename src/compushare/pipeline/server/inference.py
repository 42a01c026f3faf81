"""The provider: serves a span of blocks over /compushare/infer/1.3.0.

One handler task per stream reads frames in order; a stream may carry several
sessions. Torch runs in worker threads behind a CapacityLimiter so the event loop
keeps reading every stream (yamux resets a stream whose reader stalls for 5 s).
Bad input gets an error reply and costs nothing else: the stream stays usable,
except after an oversized frame, whose remaining bytes cannot be skipped safely.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import time

import trio
import torch
from libp2p.abc import INetStream
from libp2p.crypto.keys import KeyPair
from libp2p.network.stream.exceptions import StreamError

from ...config import ServerLimits
from ...errors import FrameError, PeerMisbehaved
from ...model.blocks import SpanRunner
from ...net.framing import FramedStream
from ...net.limits import PeerRateLimiter
from ...net.tensors import decode_tensor, encode_tensor
from .. import protocol
from ...karma.receipts import parse_receipt
from ...karma.rules import CLOCK_SKEW_S
from ...proofs import sign_step
from .push import PUSH_MAX_BYTES, Downstream, PushLinks, Speculation, parse_downstream, parse_peer
from .session import Rejected, Session, SessionTable

log = logging.getLogger(__name__)

REPLY_TIMEOUT_S = 10.0
EXPIRY_PERIOD_S = 1.0
OVERSIZE_GRACE_S = 0.5
LOAD_WINDOW_S = 10.0
RATE_EWMA = 0.2
# A one-token step whose forward the measured rate puts at or under this runs on the
# event loop itself instead of a worker thread (see _runs_inline).
INLINE_MAX_S = 0.05
PUSH_FIRST_MAX_S = 0.01  # a reply waits this long at most for its step's push to be written


class InferenceServer:
    def __init__(self, runner: SpanRunner, model_id: str, limits: ServerLimits, *, key_pair: KeyPair,
                 block_rate: float = 0.0, noise: float = 0.0, karma=None) -> None:
        self.runner = runner
        self.model_id = model_id
        self.limits = limits
        self.key_pair = key_pair  # signs every step's output
        self.noise = noise  # fault injection only: a lying server (tests, benchmarks)
        self.karma = karma  # a karma.ledger.ReceiptBook: countersigns, keeps receipts (None: no ledger)
        self.rate_limiter = PeerRateLimiter(limits.peer_requests_per_s, limits.peer_bytes_per_s)
        self._streams: collections.Counter[str] = collections.Counter()  # open infer streams per peer
        self.sessions = self._new_table()
        self.compute_limiter = trio.CapacityLimiter(limits.compute_threads)
        self.tokens_served = 0
        self.block_rate = block_rate  # decode steps/s through one block: self-benchmark, then served steps
        self.moving = False  # set while the node loads another span: new sessions would be dropped
        self.paused = False  # its user paused contributing: no new sessions
        self._busy: collections.deque[tuple[float, float, int]] = collections.deque()  # (end, seconds, tokens)
        self.pushes: PushLinks | None = None  # set by enable_push: this server pushes and takes pushes
        self._nursery: trio.Nursery | None = None
        self.speculation_hits = 0  # steps whose pushed input the consumer confirmed
        self.speculation_misses = 0

    def enable_push(self, host, nursery: trio.Nursery) -> None:
        """Let consumers link this server's sessions to their neighbours in a chain
        (pipeline/push.py); pushes and the steps they start run in `nursery`."""
        self.pushes = PushLinks(host, nursery)
        self._nursery = nursery

    def _new_table(self) -> SessionTable:
        limits = self.limits
        return SessionTable(
            budget_tokens=limits.kv_budget_tokens,
            max_session_tokens=limits.max_session_tokens,
            max_step_tokens=limits.max_step_tokens,
            idle_timeout_s=limits.session_idle_timeout_s,
            max_sessions=limits.max_sessions,
            max_sessions_per_peer=limits.max_sessions_per_peer,
        )

    def replace_runner(self, runner: SpanRunner) -> int:
        """Serve another span. Open sessions cannot follow (their caches belong to the
        old span): they are dropped, and their next step gets "unknown session"."""
        dropped = len(self.sessions)
        self.runner = runner
        self.sessions = self._new_table()
        self.moving = False
        return dropped

    def load(self, now: float | None = None) -> float:
        """Share of the last LOAD_WINDOW_S this server spent computing, 0..1."""
        now = self._trim(now)
        busy = sum(min(seconds, end - (now - LOAD_WINDOW_S)) for end, seconds, _ in self._busy)
        return min(1.0, max(0.0, busy / LOAD_WINDOW_S))

    def throughput(self, now: float | None = None) -> float:
        """Tokens/s this server computed over the last LOAD_WINDOW_S."""
        now = self._trim(now)
        return sum(tokens for _, _, tokens in self._busy) / LOAD_WINDOW_S

    def _trim(self, now: float | None) -> float:
        now = time.monotonic() if now is None else now
        while self._busy and self._busy[0][0] < now - LOAD_WINDOW_S:
            self._busy.popleft()
        return now

    def _observe(self, tokens: int, blocks: int, seconds: float) -> None:
        self._busy.append((time.monotonic(), seconds, tokens))
        if tokens == 1 and seconds > 0:  # decode steps are what the rate predicts
            sample = blocks / seconds
            self.block_rate = sample if self.block_rate <= 0 else (1 - RATE_EWMA) * self.block_rate + RATE_EWMA * sample

    async def expire_loop(self) -> None:
        while True:
            await trio.sleep(min(EXPIRY_PERIOD_S, self.limits.session_idle_timeout_s / 2))
            for session in self.sessions.expire(time.monotonic()):
                log.info("session %s expired after idling; freed %d tokens", session.session_id.hex()[:8],
                         session.max_tokens)

    async def rpc_infer(self, stream: INetStream) -> None:
        """Stream handler (task boundary: logs and swallows unexpected errors)."""
        framed = FramedStream(stream, self.limits.max_frame_bytes)
        peer = str(stream.muxed_conn.peer_id)
        if self._streams[peer] >= self.limits.max_streams_per_peer:
            log.info("refused an infer stream from %s: %d open already", peer, self._streams[peer])
            await self._reply(framed, protocol.error(
                protocol.BUSY, f"{self.limits.max_streams_per_peer} streams of this peer are open already"))
            await framed.close()
            return
        self._streams[peer] += 1
        try:
            await self._serve(framed, peer)
        except StreamError as exc:
            log.debug("infer stream ended: %s", exc)
        except Exception:
            log.exception("infer handler failed")
            await _quiet_reset(framed)
        finally:
            self._streams[peer] -= 1
            if not self._streams[peer]:
                del self._streams[peer]

    async def _serve(self, framed: FramedStream, peer: str) -> None:
        while True:
            try:
                # A stalled or silent stream (half a frame, then nothing) is closed.
                with trio.move_on_after(self.limits.stream_idle_timeout_s) as idle:
                    message = await framed.receive()
                if idle.cancelled_caught:
                    log.info("closing an infer stream of %s: idle for %.0f s", peer,
                             self.limits.stream_idle_timeout_s)
                    await _quiet_reset(framed)
                    return
            except FrameError as exc:
                await self._reply(framed, protocol.error(exc.code, exc.message))
                if exc.code == "frame_too_large":
                    # The rest of that frame cannot be skipped: end the stream, but give
                    # the error reply a moment to arrive before the reset discards it.
                    await framed.close()
                    await trio.sleep(OVERSIZE_GRACE_S)
                    await _quiet_reset(framed)
                    return
                continue
            if message is None:
                await framed.close()
                return
            reply = await self.handle(message, peer, framed.last_frame_bytes)
            if reply is not None:  # a push that was taken gets no reply
                await self._reply(framed, reply)

    async def _reply(self, framed: FramedStream, reply: dict) -> None:
        with trio.fail_after(REPLY_TIMEOUT_S):
            await framed.send(reply)

    async def handle(self, message: dict, peer: str = "", nbytes: int = 0) -> dict | None:
        session_id = message.get("session")
        try:
            wait = self.rate_limiter.check(peer, nbytes, time.monotonic())
            if wait:
                reply = protocol.error(protocol.RATE_LIMITED, f"too many requests or bytes from this peer; "
                                       f"retry in {wait:.2f} s")
                reply["retry_after_s"] = wait
                return reply
            if not isinstance(session_id, bytes) or len(session_id) != protocol.SESSION_ID_BYTES:
                raise Rejected(protocol.BAD_REQUEST, f"'session' must be {protocol.SESSION_ID_BYTES} bytes")
            kind = message["type"]
            if kind == "step":
                return await self._step(session_id, message)
            if kind == "push":
                return self._push(session_id, message, peer)
            if kind == "link":
                return await self._link(session_id, message, peer)
            if kind == "open":
                return self._open(session_id, message, peer)
            if kind == "truncate":
                position = _int(message, "position")
                await self._discard_speculation(self.sessions.get(session_id))
                session = self.sessions.truncate(session_id, position, time.monotonic())
                self.runner.truncate(session.cache, position)
                return {"type": "truncated", "session": session_id, "position": position}
            if kind == "receipt":
                return await self._receipt(session_id, message, peer)
            if kind == "close":
                self.sessions.close(session_id)
                return {"type": "closed", "session": session_id}
            raise Rejected(protocol.BAD_REQUEST, f"unknown message type {kind!r}")
        except (Rejected, FrameError) as exc:
            return protocol.error(exc.code, exc.message, session_id if isinstance(session_id, bytes) else None)

    def _open(self, session_id: bytes, message: dict, peer: str) -> dict:
        if self.moving:
            raise Rejected(protocol.BUSY, "this server is moving to other blocks")
        if self.paused:
            raise Rejected(protocol.BUSY, "this server's user paused contributing")
        if message.get("model") != self.model_id:
            raise Rejected(protocol.WRONG_MODEL, f"this server serves model {self.model_id}")
        start, end = _int(message, "start"), _int(message, "end")
        if not (self.runner.start <= start < end <= self.runner.end):
            raise Rejected(protocol.BAD_SPAN, f"{start}:{end} is not within {self.runner.start}:{self.runner.end}")
        session = self.sessions.open(session_id, start, end, _int(message, "max_tokens"), time.monotonic(),
                                     owner=peer)
        session.cache = self.runner.new_cache()
        return {"type": "opened", "session": session_id, "free_tokens": self.sessions.free_tokens}

    async def _receipt(self, session_id: bytes, message: dict, peer: str) -> dict:
        """Countersign the consumer's receipt for this session's latest steps, if it
        describes them truthfully: never more tokens or compute than this server ran
        since the last receipt, never more compute than the consumer's wall time."""
        if self.karma is None:
            raise Rejected(protocol.BAD_REQUEST, "this server keeps no karma ledger")
        session = self.sessions.get(session_id)
        if peer != session.owner:
            raise Rejected(protocol.BAD_RECEIPT, "only the consumer that opened a session may receipt it")
        wire = message.get("receipt")
        try:
            receipt = parse_receipt(wire, countersigned=False)
        except PeerMisbehaved as exc:
            raise Rejected(protocol.BAD_RECEIPT, str(exc)) from None
        expected = {"server": self.karma.peer_id, "consumer": peer, "model_id": self.model_id,
                    "start": session.start, "end": session.end, "session": session_id, "seq": session.receipt_seq}
        for name, value in expected.items():
            if getattr(receipt, name) != value:
                raise Rejected(protocol.BAD_RECEIPT, f"receipt {name} is {getattr(receipt, name)!r}, expected {value!r}")
        if receipt.tokens > session.unreceipted_tokens:
            raise Rejected(protocol.BAD_RECEIPT, f"receipt claims {receipt.tokens} tokens; "
                                                 f"{session.unreceipted_tokens} ran since the last one")
        if receipt.compute_ms > session.unreceipted_ms * (1 + 1e-9) + 1e-6:
            raise Rejected(protocol.BAD_RECEIPT, f"receipt claims {receipt.compute_ms:.1f} ms of compute; "
                                                 f"{session.unreceipted_ms:.1f} ms ran since the last one")
        if receipt.compute_ms > receipt.wall_ms:
            raise Rejected(protocol.BAD_RECEIPT, "receipt compute time exceeds the consumer's wall time")
        if abs(receipt.time - time.time()) > CLOCK_SKEW_S:
            raise Rejected(protocol.BAD_RECEIPT, "receipt time is too far from this server's clock")
        try:
            signed = await self.karma.accept(wire, receipt)
        except PeerMisbehaved as exc:  # its slot is taken, or it is too large
            raise Rejected(protocol.BAD_RECEIPT, str(exc)) from None
        except OSError as exc:  # the ledger cannot be written: say so, keep serving
            log.error("could not keep a receipt: %s", exc)
            raise Rejected(protocol.INTERNAL, "this server could not store the receipt") from None
        session.receipt_seq += 1
        session.unreceipted_tokens, session.unreceipted_ms = 0, 0.0
        return {"type": "receipted", "session": session_id, "receipt": signed}

    async def _step(self, session_id: bytes, message: dict) -> dict:
        position = _int(message, "position")
        # A move to another span swaps both mid-step: this step finishes on the old ones.
        sessions, runner = self.sessions, self.runner
        session = sessions.get(session_id)  # unknown session before decoding the tensor
        wire = message.get("hidden")
        hidden = decode_tensor(wire, hidden_size=runner.hidden_size, max_tokens=self.limits.max_step_tokens)
        tokens = hidden.shape[1]
        chunks = _chunks(message.get("chunks"), tokens)
        last_only = message.get("last_only", False) is True
        speculation = await self._confirm_speculation(session, position, wire, chunks)
        if speculation is not None:  # computed (and pushed on) from the upstream server's push already
            output, seconds, encoded = speculation.output, speculation.seconds, speculation.encoded
        else:
            session = sessions.begin_step(session_id, position, tokens, time.monotonic())
            output, seconds = await self._compute(runner, session, hidden, position, chunks)
            encoded = encode_tensor(output.to(hidden.dtype))  # reply in the request's dtype
            if len(chunks) == 1:  # a replay (chunks) is not worth pushing
                # Queued before the reply: the next hop starts before the consumer's copy arrives.
                self._push_on(session.downstream, position, encoded)
        sessions.end_step(session, tokens, time.monotonic(), ok=True)
        self.tokens_served += tokens
        session.unreceipted_tokens += tokens
        session.unreceipted_ms += seconds * 1000
        if last_only:
            output = output[:, -chunks[-1]:]
            encoded = encode_tensor(output.to(hidden.dtype))
        reply = {"type": "result", "session": session_id, "position": position, "hidden": encoded,
                 "compute_ms": seconds * 1000}
        if session.digest is not None:
            session.digest.update(wire["data"])
            reply["proof"] = self._prove(session, position + tokens - chunks[-1], chunks[-1], encoded["data"],
                                         output.shape[1])
        if session.downstream is not None and self.pushes is not None:
            await self.pushes.flushed(session.downstream.peer, PUSH_FIRST_MAX_S)  # this step's push goes first
        return reply

    async def _compute(self, runner: SpanRunner, session: Session, hidden: torch.Tensor, position: int,
                       chunks: list[int]) -> tuple[torch.Tensor, float]:
        """Run one begun step in a worker thread; on failure the cache is rolled back
        and the step ended, and the error propagates."""

        def compute() -> tuple:
            # Chunks run one after another, exactly as the original steps did: a replayed
            # history then rebuilds the very same KV cache (one batched prefill would not).
            # Timed in the worker: waiting for the limiter is queueing (load), not speed.
            began = time.perf_counter()
            outputs, offset = [], 0
            for size in chunks:
                outputs.append(runner.forward(hidden[:, offset:offset + size], session.cache, position + offset,
                                              session.start, session.end))
                offset += size
            out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
            if self.noise > 0:
                out = out + torch.randn_like(out) * self.noise * out.abs().mean()
            return out, time.perf_counter() - began

        try:
            if self._runs_inline(runner, chunks, session.end - session.start):
                async with self.compute_limiter:  # never beside a long step in a worker thread
                    output, seconds = compute()
            else:
                output, seconds = await trio.to_thread.run_sync(compute, limiter=self.compute_limiter)
        except BaseException:
            runner.truncate(session.cache, position)  # a failed forward may have half-appended
            self.sessions.end_step(session, hidden.shape[1], time.monotonic(), ok=False)
            raise
        self._observe(hidden.shape[1], session.end - session.start, seconds)
        return output, seconds

    def _runs_inline(self, runner: SpanRunner, chunks: list[int], blocks: int) -> bool:
        """Whether a step runs on the event loop rather than in a worker thread.

        A decode step's forward is hundreds of small torch ops, each releasing the GIL.
        In a worker thread it shares the GIL with this loop's network work (py-libp2p
        is pure Python), which takes the GIL at every op and keeps it for its burst:
        the pipeline-overhead swarm measured 2.6-4.6 ms per forward asleep on the GIL,
        plus the thread hand-off, and 109 against 122 ms per token inline vs in a
        thread, the same run. Inline holds the loop for the forward's duration, so
        only short one-token steps qualify, predicted from the measured rate; prefills,
        replays, several compute threads and slowed runners stay in threads."""
        if chunks != [1] or self.compute_limiter.total_tokens != 1 or runner.slowdown > 1.0:
            return False
        return self.block_rate > 0 and blocks / self.block_rate <= INLINE_MAX_S

    # -- pushes (pipeline/push.py) ------------------------------------------------------

    async def _link(self, session_id: bytes, message: dict, peer: str) -> dict:
        """The consumer names this session's neighbours in its chain: who may push
        inputs here (`upstream`) and where outputs go (`downstream`, nil: nowhere)."""
        session = self.sessions.get(session_id)
        if peer != session.owner:
            raise Rejected(protocol.BAD_REQUEST, "only the consumer that opened a session may link it")
        if self.pushes is None:
            raise Rejected(protocol.BAD_REQUEST, "this server does not take part in pushes")
        upstream = message.get("upstream")
        upstream = None if upstream is None else parse_peer(upstream, "upstream")
        downstream = parse_downstream(message.get("downstream"))
        if downstream is not None:
            self.pushes.ensure(downstream)  # dialled in the background: pushes start once it is up
        session.upstream, session.downstream = upstream, downstream
        return {"type": "linked", "session": session_id}

    def _push_on(self, downstream: Downstream | None, position: int, encoded: dict) -> None:
        if downstream is not None and len(encoded["data"]) <= PUSH_MAX_BYTES:
            self.pushes.push(downstream, position, encoded)

    def _push(self, session_id: bytes, message: dict, peer: str) -> None:
        """Start computing a step from the upstream server's output; the consumer's own
        step for that position then finds it done (or computing)."""
        if self._nursery is None:
            raise Rejected(protocol.BAD_REQUEST, "this server does not take pushes")
        sessions, runner = self.sessions, self.runner
        session = sessions.get(session_id)
        if session.upstream is None or peer != session.upstream:
            raise Rejected(protocol.BAD_REQUEST, "this session takes no pushes from this peer")
        position = _int(message, "position")
        wire = message.get("hidden")
        hidden = decode_tensor(wire, hidden_size=runner.hidden_size, max_tokens=self.limits.max_step_tokens)
        session = sessions.begin_step(session_id, position, hidden.shape[1], time.monotonic())
        session.speculation = speculation = Speculation(runner, position, hidden.shape[1], bytes(wire["data"]),
                                                         wire["dtype"])
        self._nursery.start_soon(self._speculate, runner, session, speculation, hidden)
        return None

    async def _speculate(self, runner: SpanRunner, session: Session, speculation: Speculation,
                         hidden: torch.Tensor) -> None:
        try:
            # The step stays begun: it ends when the consumer's copy of its input comes.
            speculation.output, speculation.seconds = await self._compute(
                runner, session, hidden, speculation.position, [speculation.tokens])
        except Exception as exc:  # _compute rolled the cache back and ended the step
            log.info("a pushed step failed: %s", exc)
            if session.speculation is speculation:
                session.speculation = None
        else:  # encoded once: the push and, once confirmed, the reply
            speculation.encoded = encode_tensor(speculation.output.to(hidden.dtype))
            self._push_on(session.downstream, speculation.position, speculation.encoded)
        finally:
            speculation.finished = True
            speculation.done.set()

    async def _confirm_speculation(self, session: Session, position: int, wire: dict,
                                   chunks: list[int]) -> Speculation | None:
        """The step computed from a push, if the consumer's step carries the same input
        at the same position (it is still begun); otherwise any is rolled back."""
        while True:  # a failed one may have been followed by another push meanwhile
            speculation = session.speculation
            if speculation is None:
                return None
            await speculation.done.wait()
            if session.speculation is speculation:
                break
        session.speculation = None
        if speculation.matches(position, bytes(wire["data"]), wire["dtype"], chunks):
            self.speculation_hits += 1
            return speculation
        self.speculation_misses += 1
        speculation.runner.truncate(session.cache, speculation.position)
        self.sessions.end_step(session, speculation.tokens, time.monotonic(), ok=False)
        return None

    async def _discard_speculation(self, session: Session) -> None:
        speculation = session.speculation
        if speculation is None:
            return
        await speculation.done.wait()
        if session.speculation is speculation:
            session.speculation = None
            speculation.runner.truncate(session.cache, speculation.position)
            self.sessions.end_step(session, speculation.tokens, time.monotonic(), ok=False)

    def _prove(self, session, position: int, tokens: int, data: bytes, returned_tokens: int) -> dict:
        """Sign the last chunk's output: the last `tokens` of the `returned_tokens` in `data`."""
        last = memoryview(data)[len(data) - len(data) // returned_tokens * tokens:]
        input_digest = session.digest.digest()
        signature = sign_step(self.key_pair, self.model_id, session.start, session.end, position, tokens,
                              input_digest, hashlib.sha256(last).digest())
        return {"position": position, "tokens": tokens, "input_digest": input_digest, "sig": signature}


def _chunks(value: object, tokens: int) -> list[int]:
    """The step's chunk sizes: absent means one chunk of every token."""
    if value is None:
        return [tokens]
    if (not isinstance(value, list) or not value
            or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in value)
            or sum(value) != tokens):
        raise Rejected(protocol.BAD_REQUEST, f"'chunks' must be positive integers summing to {tokens}")
    return value


def _int(message: dict, name: str) -> int:
    value = message.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise Rejected(protocol.BAD_REQUEST, f"{name!r} must be a non-negative integer")
    return value


async def _quiet_reset(framed: FramedStream) -> None:
    try:
        await framed.reset()
    except Exception:
        pass
