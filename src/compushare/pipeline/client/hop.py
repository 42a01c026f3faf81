"""One session on one server of a chain, over /compushare/infer: the consumer's hop I/O.

One stream per hop carries every step of the session. Every request has a deadline
that follows the hop's observed latency (deadlines.Pace), so a hung server is
noticed in about a second, not after a fixed 30 s; a "rate limited" reply is retried
within it. A step past its deadline on a hop nothing could replace is waited for
while its server answers pings (deadlines.wait_more, `Patience`). Every failure is a
HopFailed naming the server. Receipts (karma) are signed and countersigned here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Awaitable, Callable

import torch
import trio
from libp2p.abc import IHost
from libp2p.host.ping import PingService
from libp2p.network.stream.exceptions import StreamError
from libp2p.peer.id import ID

from ...errors import (
    BAD_REPLY, CLOSED, CONNECTION_LOST, TIMEOUT, UNREACHABLE, WRONG_FORMAT, FrameError, HopFailed, HopUnavailable,
    PeerMisbehaved, RemoteError, ServerBusy,
)
from ...karma.receipts import Receipt, parse_receipt, sign_receipt
from ...net.codec import DEFAULT_MAX_FRAME
from ...net.dial import dial
from ...net.framing import FramedStream
from ...net.tensors import decode_tensor, encode_tensor
from ...proofs.inference import DEFAULT_MODE, step_digest
from ...wire import BAD_ADAPTER
from .. import protocol
from ..messages import (
    CloseRequest, Downstream, ErrorReply, FromUpstream, LinkRequest, OpenRequest, Proof, ReceiptRequest, Reply,
    Request, Result, StepRequest, WireTensor, decode_reply,
)
from .deadlines import PING_TIMEOUT_S, Lateness, Pace, wait_more
from .routing import Hop


log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
RECEIPT_TIMEOUT_S = 2.0


@dataclasses.dataclass(frozen=True)
class Patience:
    """How a hop's late steps are waited for: up to `limit_s` after they were sent,
    while `replaceable()` says no other server could take the hop's blocks and the
    server answers pings on `host`."""

    host: IHost
    limit_s: float
    replaceable: Callable[[], bool]


@dataclasses.dataclass
class Usage:
    """A session's steps since its last receipt, as the consumer saw them."""

    seq: int = 0
    tokens: int = 0
    compute_ms: float = 0.0  # what the server reported, each step capped by its wall time
    wall_ms: float = 0.0

    def add(self, tokens: int, compute_ms: float, wall_ms: float) -> None:
        self.tokens += tokens
        self.compute_ms += min(max(compute_ms, 0.0), wall_ms)
        self.wall_ms += wall_ms


@dataclasses.dataclass(frozen=True)
class StepResult:
    output: torch.Tensor  # [1, n, H] (all chunks, or the last one with last_only)
    data: bytes  # the output's wire bytes (what the proof signs)
    dtype: str
    proof: Proof | None
    input_digest: bytes = b""  # of the input sent (proofs.inference.step_digest); empty for a step from_upstream


class RemoteHop:
    """One open session: its own id, so that one server can hold a hop and a spot
    check (or a replacement) of the same chain."""

    def __init__(self, hop: Hop, framed: FramedStream, hidden_size: int, session_id: bytes) -> None:
        self.hop = hop
        self.session_id = session_id
        self.framed = framed
        self.hidden_size = hidden_size
        # Seconds per decode step, observed; of which the server's compute (as it
        # reports it, within the wall time observed).
        latency = max(hop.expected_s, 0.005)
        self.pace = Pace(latency, hop.compute_s or latency)
        self.patience: Patience | None = None  # None: a late step is given up (HopFailed timeout)
        self.late_waits = 0  # steps waited for past their deadline
        self.usage = Usage()  # what the next receipt covers
        # The compute mode its step proofs must sign: the model's weight format. A proof
        # in another mode could never meet an honest witness's in a failure report.
        self.mode = DEFAULT_MODE

    @property
    def peer_id(self) -> str:
        return self.hop.peer_id

    def _where(self) -> str:
        return f"{self.peer_id} (blocks {self.hop.start}:{self.hop.end})"

    @property
    def latency(self) -> float:
        return self.pace.latency

    @property
    def compute(self) -> float:
        return self.pace.compute

    def deadline(self, tokens: int, chunks: int = 1) -> float:
        return self.pace.deadline(tokens, chunks)

    async def request(self, message: Request, timeout: float, tighten: tuple[trio.Event, float] | None = None,
                      *, patient: bool = False, clock: _Deadline | None = None) -> Reply:
        """Send, await the reply (checked by messages.decode_reply against `message`);
        a "rate limited" reply is retried within the deadline. Every failure is a
        HopFailed naming this server ("bad_reply": a reply that is not an answer to
        `message`), or ServerBusy. With `tighten` (event, seconds), the deadline
        becomes at most `seconds` after the event (a hop waiting for its upstream's
        push, once the upstream has answered). `patient`: past its deadline, the
        request is waited for as self.patience allows."""
        clock = clock or _Deadline(trio.current_time(), timeout)
        try:
            reply = await clock.run(self._exchange(message), tighten,
                                    self._late if patient and self.patience is not None else None)
        except trio.TooSlowError:
            raise HopFailed(self.peer_id, TIMEOUT, f"{self._where()} did not answer within {clock.given:.1f}s") \
                from None
        except (StreamError, FrameError) as exc:
            raise HopFailed(self.peer_id, CONNECTION_LOST,
                            f"lost the stream to {self._where()}: {str(exc) or type(exc).__name__}") from None
        except PeerMisbehaved as exc:
            raise HopFailed(self.peer_id, BAD_REPLY, f"{self._where()}: {exc}") from None
        if isinstance(reply, ErrorReply):
            if reply.code == protocol.BUSY:
                raise ServerBusy(reply.code, f"{self._where()}: {reply.message}")
            raise HopFailed(self.peer_id, reply.code, f"{self._where()}: {reply.message}")
        return reply

    async def _late(self, waited_s: float, timeout_s: float) -> float:
        """Seconds more to wait for a request past its deadline (0: give it up)."""
        patience = self.patience
        replaceable = patience.replaceable()
        alive = not replaceable and await self.alive(patience.host)
        more = wait_more(Lateness(waited_s, timeout_s, patience.limit_s, replaceable, alive))
        if more:
            self.late_waits += 1
            log.info("%s is late (%.1fs, deadline %.1fs) but answers pings and nothing could replace it: "
                     "waiting %.1fs more", self._where(), waited_s, timeout_s, more)
        return more

    async def alive(self, host: IHost) -> bool:
        """Whether the server answers a ping within PING_TIMEOUT_S (a new stream on
        the hop's connection: a stopped or cut-off server does not)."""
        with trio.move_on_after(PING_TIMEOUT_S):
            try:
                async for _rtt in PingService(host).ping_iter(ID.from_base58(self.peer_id), ping_amt=1):
                    return True
            except Exception as exc:  # any failure to ping is a failed ping
                log.debug("%s did not answer a ping: %s", self._where(), exc)
                return False
        return False

    async def _exchange(self, message: Request) -> Reply:
        """Send, and read the reply (a "rate limited" one: wait, send again)."""
        while True:
            await self.framed.send(message.to_wire())
            raw = await self.framed.receive()
            if raw is None:
                raise HopFailed(self.peer_id, CLOSED, f"{self._where()} closed the stream")
            reply = decode_reply(raw, message)
            if not (isinstance(reply, ErrorReply) and reply.code == protocol.RATE_LIMITED):
                return reply
            wait = reply.retry_after_s
            await trio.sleep(min(wait, 5.0) if wait is not None else 0.1)

    async def step(self, hidden: torch.Tensor, position: int, *,
                   chunks: list[int] | None = None, last_only: bool = False, rollback: bool = False) -> StepResult:
        tokens = hidden.shape[1]
        encoded = encode_tensor(hidden)
        message = StepRequest(self.session_id, position,
                              WireTensor(encoded["dtype"], tuple(encoded["shape"]), encoded["data"]),
                              tuple(chunks) if chunks is not None and len(chunks) > 1 else None, last_only, rollback)
        return await self._step(message, self.deadline(tokens, len(chunks or [tokens])), learn=tokens == 1)

    async def step_from_upstream(self, position: int, tokens: int, wait_s: float, *,
                                 rollback: bool = False, upstream: trio.Event | None = None) -> StepResult:
        """Direct return: the step whose input the upstream server pushes here. The
        server waits `wait_s` for it (then `no_input`); this side waits that and the
        step's own deadline, or its own deadline from when `upstream` (the previous
        hop answered) is set, whichever comes first."""
        wait_ms = min(protocol.MAX_WAIT_MS, max(0, round(wait_s * 1000)))
        message = StepRequest(self.session_id, position, None, rollback=rollback,
                              from_upstream=FromUpstream(tokens, wait_ms))
        own = self.deadline(tokens)
        # Its wall time counts the upstream hops too: not this hop's latency (what it
        # takes from the upstream's answer on is learnt instead, in _step).
        return await self._step(message, wait_ms / 1000 + own, learn=False,
                                tighten=None if upstream is None else (upstream, own))

    async def _step(self, message: StepRequest, timeout: float, *, learn: bool,
                    tighten: tuple[trio.Event, float] | None = None) -> StepResult:
        began = time.perf_counter()
        clock = _Deadline(trio.current_time(), timeout)
        try:
            reply: Result = await self.request(message, timeout, tighten, patient=True, clock=clock)
        except ServerBusy as exc:  # busy mid-session: as good as gone for this session
            raise HopFailed(self.peer_id, exc.code, exc.message) from None
        try:  # type, position and token count were checked by decode_reply; the values here
            output = decode_tensor(reply.hidden.to_wire(), hidden_size=self.hidden_size,
                                   max_tokens=message.reply_tokens)
        except PeerMisbehaved as exc:
            raise HopFailed(self.peer_id, BAD_REPLY, f"{self._where()}: {exc}") from None
        if reply.proof is not None and reply.proof.mode != self.mode:
            raise HopFailed(self.peer_id, BAD_REPLY, f"{self._where()}: its step proof names compute mode "
                            f"{reply.proof.mode[:16]!r}, not the model's {self.mode!r}")
        wall = time.perf_counter() - began
        own = wall if learn else None
        if clock.tightened_at is not None and message.tokens == 1:  # a direct decode step: from its upstream on
            own = trio.current_time() - clock.tightened_at
        if own is not None:
            # An older server reports no compute time: its whole wall time counts.
            compute = min(reply.compute_ms / 1000, wall) if reply.compute_ms > 0 else own
            self.pace.observe(max(own, compute), compute)
        self.usage.add(message.tokens, reply.compute_ms, wall * 1000)
        sent = b""
        if message.hidden is not None:
            sent = step_digest(message.hidden.dtype, message.hidden.data, message.tokens)
        return StepResult(output, reply.hidden.data, reply.hidden.dtype, reply.proof, sent)

    async def link(self, upstream: str | None, downstream: RemoteHop | None) -> bool:
        """Tell the server its neighbours, so it pushes its output straight to the next
        hop (pipeline/server/push.py); whether it took the link. A refusal only costs
        the time pushes save; a late answer is waited for as a step's is."""
        target = None if downstream is None else Downstream(
            downstream.peer_id, tuple(downstream.hop.record.addrs), downstream.session_id)
        message = LinkRequest(self.session_id, upstream, target)
        try:
            await self.request(message, self.deadline(1), patient=True)
        except RemoteError as exc:  # refused (busy, bad request...): the chain works without pushes
            log.debug("%s will not push: %s", self.peer_id, exc)
            if isinstance(exc, HopFailed) and exc.code in (TIMEOUT, CONNECTION_LOST, CLOSED):
                await self.abort()  # a late reply would desync the stream: its next step fails over
            return False
        return True

    async def send_receipt(self, host: IHost, model_id: str) -> None:
        """Sign what this session has run since the last receipt and have the server
        countersign it (its karma). A refusal costs the server only its own credit;
        a hop that does not answer in time (nor is waited for, as a step would be) is
        aborted (its stream could deliver the late reply in place of the next step's):
        the next step fails over."""
        usage = self.usage
        if not usage.tokens:
            return
        receipt = Receipt(self.peer_id, host.get_id().to_string(), model_id, self.hop.start, self.hop.end,
                          self.session_id, usage.seq, usage.tokens, min(usage.compute_ms, usage.wall_ms),
                          usage.wall_ms, time.time())
        wire = sign_receipt(receipt, host.get_private_key())
        self.usage = Usage(seq=usage.seq)  # those steps are settled, accepted or not
        try:
            reply = await self.request(ReceiptRequest(self.session_id, wire), RECEIPT_TIMEOUT_S, patient=True)
            parse_receipt(reply.receipt)  # countersigned by the server it names
        except RemoteError as exc:  # HopFailed, or a (misplaced) busy
            if exc.code == BAD_REPLY:  # answered, but not with a receipt
                log.info("%s answered a receipt with a bad countersignature: %s", self._where(), exc)
                self.usage.seq = usage.seq + 1
                return
            if exc.code in (protocol.BAD_RECEIPT, protocol.BAD_REQUEST, protocol.INTERNAL, protocol.BUSY):
                log.info("%s did not countersign a receipt: %s", self._where(), exc)
                return  # refused: the server's seq did not move, neither does ours
            log.info("no answer to a receipt from %s: %s", self._where(), exc)
            await self.abort()
            return
        except PeerMisbehaved as exc:
            log.info("%s answered a receipt with a bad countersignature: %s", self._where(), exc)
        self.usage.seq = usage.seq + 1

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.request(CloseRequest(self.session_id), timeout=1)
            await self.framed.close()

    async def abort(self) -> None:
        with contextlib.suppress(Exception):
            await self.framed.reset()


class _Deadline:
    """One request's deadline: `timeout` after `began` (trio time); earlier, `seconds`
    after a tighten event, once that is set; later, as long as `late` (seconds since
    `began`, the deadline given) answers more seconds to wait."""

    def __init__(self, began: float, timeout: float) -> None:
        self.began = began
        self.given = timeout  # in the end, how long the request was given in all
        self.tightened_at: float | None = None  # when the tighten event was set
        self._expiry = trio.CancelScope(deadline=began + timeout)
        self._late = False

    async def run(self, exchange, tighten: tuple[trio.Event, float] | None,
                  late: Callable[[float, float], Awaitable[float]] | None) -> Reply:
        """Await `exchange` within the deadline (else trio.TooSlowError). Its errors
        come out as themselves, not in an exception group."""
        outcome: dict = {}
        async with trio.open_nursery() as nursery:
            async def perform() -> None:
                try:
                    outcome["reply"] = await exchange
                except Exception as exc:  # raised below, outside the nursery
                    outcome["error"] = exc
                nursery.cancel_scope.cancel()

            nursery.start_soon(perform)
            if tighten is not None:
                nursery.start_soon(self._tighten, *tighten)
            await self._expire(late)
            nursery.cancel_scope.cancel()
        if "error" in outcome:
            raise outcome["error"]
        if "reply" in outcome:
            return outcome["reply"]
        raise trio.TooSlowError

    async def _tighten(self, event: trio.Event, seconds: float) -> None:
        await event.wait()
        self.tightened_at = trio.current_time()
        if not self._late:
            self._expiry.deadline = min(self._expiry.deadline, self.tightened_at + seconds)

    async def _expire(self, late) -> None:
        """Returns when the deadline has passed and no more waiting is allowed."""
        while True:
            with self._expiry:
                await trio.sleep_forever()
            now = trio.current_time()
            timeout = self._expiry.deadline - self.began if not self._late else self.given
            more = 0.0 if late is None else await late(now - self.began, timeout)
            if not more:
                self.given = trio.current_time() - self.began
                return
            self._late = True
            self.given = timeout
            self._expiry = trio.CancelScope(deadline=trio.current_time() + more)


async def open_hop(host: IHost, hop: Hop, model_id: str, max_tokens: int, hidden_size: int, *,
                   fmt: str | None = None, adapter: dict | None = None) -> RemoteHop:
    """Dial the server and open a new session on it; every failure is a HopUnavailable.
    With `fmt`, a server whose span computes in another weight format is refused.
    `adapter`: the LoRA adapter's slice for the hop's blocks, on the wire (client/adapters.py)."""
    session_id = os.urandom(protocol.SESSION_ID_BYTES)
    try:
        with trio.fail_after(CONNECT_TIMEOUT_S):
            info = await dial(host, hop.peer_id, hop.record.addrs, timeout=CONNECT_TIMEOUT_S)
            stream = await host.new_stream(info.peer_id, [protocol.INFER_PROTOCOL])
        remote = RemoteHop(hop, FramedStream(stream, DEFAULT_MAX_FRAME), hidden_size, session_id)
        opened = await remote.request(OpenRequest(session_id, model_id, hop.start, hop.end, max_tokens, adapter),
                                      timeout=CONNECT_TIMEOUT_S)
        remote.mode = fmt or DEFAULT_MODE
        # A server from before adapters ignores the field (and says no digest): it would compute without.
        if adapter is not None and opened.adapter != adapter["digest"]:
            with contextlib.suppress(Exception):
                await remote.close()
            raise HopUnavailable(hop.peer_id, BAD_ADAPTER, f"{hop.peer_id} (blocks {hop.start}:{hop.end}) did not "
                                 f"take the session's LoRA adapter (a server without adapters): refused")
        # A server that names no format is an older one: it computes fp32 models in fp32.
        if fmt is not None and (opened.format or DEFAULT_MODE) != fmt:
            with contextlib.suppress(Exception):
                await remote.close()
            raise HopUnavailable(hop.peer_id, WRONG_FORMAT, f"{hop.peer_id} computes blocks {hop.start}:{hop.end} "
                                 f"in format {opened.format or '(unsaid)'}, not the model's {fmt}: refused")
        return remote
    except HopUnavailable:
        raise
    except RemoteError as exc:
        raise HopUnavailable(hop.peer_id, exc.code, exc.message) from None
    except Exception as exc:  # dial and stream failures come in many types
        raise HopUnavailable(hop.peer_id, UNREACHABLE, f"could not reach {hop.peer_id} (blocks "
                             f"{hop.start}:{hop.end}): {str(exc) or type(exc).__name__}") from None
