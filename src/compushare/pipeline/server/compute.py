"""Where a step's forward runs, and what this server measures of its compute.

A step is computed as pieces (scheduler.pieces), each waiting for its turn in the
FairScheduler, so one peer's long prefill cannot hold another's decode step for
more than one piece. Torch runs in worker threads, so the event loop keeps
reading every stream (yamux resets a stream whose reader stalls for 5 s); a short
one-token step runs on the event loop itself (`runs_inline`). Every step's compute
time feeds the load and throughput this server advertises, and decode steps refine
its decode rate (block-steps/s), which predicts how long the next one takes.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import torch
import trio

from ...spans import SpanCompute
from ...net.tensors import encode_tensor
from .. import protocol
from ..messages import WireTensor
from .scheduler import SHORT_TOKENS, FairScheduler, Ticket, pieces
from .session import Rejected

T = TypeVar("T")

LOAD_WINDOW_S = 10.0
RATE_EWMA = 0.2
# A one-token step whose forward the measured rate puts at or under this runs on the
# event loop itself instead of a worker thread (see runs_inline).
INLINE_MAX_S = 0.05
PAUSE_POLL_S = 0.0005  # how often a short piece looks whether the long forwards have paused
JOIN_YIELDS = 8  # checkpoints a batch's leader lets pass before it closes the batch


@dataclasses.dataclass(eq=False)
class _Decode:
    """A one-token step waiting to join a batch (`Compute._batch`)."""

    cache: object
    hidden: torch.Tensor
    position: int
    peer: str
    reclaimed: Callable[[], bool]
    adapter: object = None  # its session's LoRA adapter (model/lora.py); batched steps may differ
    done: trio.Event = dataclasses.field(default_factory=trio.Event)
    lead: bool = False  # woken to lead the next batch (the one before it was full)
    output: torch.Tensor | None = None
    seconds: float = 0.0
    error: BaseException | None = None


def _batched():
    """Batched decoding, the torch runtime's (imported when used: its modules load
    transformers, some 110 MB a ggml node never needs)."""
    from ...model import batched

    return batched


class ComputeMeter:
    """What this server measures of its compute: the load and throughput it
    advertises, and its decode rate, which predicts how long the next step takes."""

    def __init__(self, block_rate: float) -> None:
        self.block_rate = block_rate  # decode steps/s through one block: self-benchmark, then served steps
        self.busy: collections.deque[tuple[float, float, int]] = collections.deque()  # (end, seconds, tokens)

    def observe(self, tokens: int, blocks: int, seconds: float) -> None:
        self.busy.append((time.monotonic(), seconds, tokens))
        if tokens == 1 and seconds > 0:  # decode steps are what the rate predicts
            sample = blocks / seconds
            self.block_rate = sample if self.block_rate <= 0 else (1 - RATE_EWMA) * self.block_rate + RATE_EWMA * sample

    def load(self, now: float | None = None) -> float:
        """Share of the last LOAD_WINDOW_S this server spent computing, 0..1."""
        now = self._trim(now)
        busy = sum(min(seconds, end - (now - LOAD_WINDOW_S)) for end, seconds, _ in self.busy)
        return min(1.0, max(0.0, busy / LOAD_WINDOW_S))

    def throughput(self, now: float | None = None) -> float:
        """Tokens/s this server computed over the last LOAD_WINDOW_S."""
        now = self._trim(now)
        return sum(tokens for _, _, tokens in self.busy) / LOAD_WINDOW_S

    def _trim(self, now: float | None) -> float:
        now = time.monotonic() if now is None else now
        while self.busy and self.busy[0][0] < now - LOAD_WINDOW_S:
            self.busy.popleft()
        return now


class Workers:
    """The worker threads a server computes in, at most `limit` at once, each job run
    with the torch team (intra-op threads) this process computes with on its event
    loop. A thread's team is its own (torch.set_num_threads sets the calling
    thread's) and trio reuses its threads, so without this a result would depend on
    which thread ran it: a reduction split over another number of threads differs
    in its last bits (tests/unit/test_training_server.py measures by how much)."""

    def __init__(self, limit: int, team: int | None = None) -> None:
        self.limiter = trio.CapacityLimiter(limit)
        self.team = team or torch.get_num_threads()

    async def run(self, fn: Callable[..., T], *args) -> T:
        return await trio.to_thread.run_sync(self._in_team, fn, *args, limiter=self.limiter)

    def _in_team(self, fn: Callable[..., T], *args) -> T:
        if torch.get_num_threads() != self.team:
            torch.set_num_threads(self.team)
        return fn(*args)


class Compute(ComputeMeter):
    def __init__(self, threads: int, *, block_rate: float = 0.0, noise: float = 0.0, fair: bool = True) -> None:
        self.scheduler = FairScheduler(threads, fair=fair)
        self.workers = Workers(2 * threads)  # long pieces, and short ones preempting them
        self._preempt = threading.Condition()  # guards the scheduler's counts that worker threads read
        self._in_long = 0  # long forwards running (in worker threads)
        self._paused = 0  # ... of which waiting at a pause point
        self._granted: dict[Ticket, trio.Event] = {}
        super().__init__(block_rate)
        self.noise = noise  # fault injection only: a lying server (tests, benchmarks)
        # Batching: one-token steps of one span waiting at once run as one forward.
        self._waiting: dict[tuple, list[_Decode]] = {}
        self.batches = 0  # forwards of more than one step
        self.batched_steps = 0  # ... and the steps they computed

    async def run(self, runner: SpanCompute, cache: object, hidden: torch.Tensor, position: int, start: int,
                  end: int, chunks: list[int], peer: str = "",
                  reclaimed: Callable[[], bool] = lambda: False, adapter=None) -> tuple[torch.Tensor, float]:
        """The output of blocks start:end for `hidden` at `position` (with `adapter`'s
        LoRA updates, if any), and the seconds its forwards took (waiting for turns
        is queueing, not speed). On failure the cache may hold part of the step: the
        caller rolls it back. A step whose session is `reclaimed` meanwhile stops
        before its next piece (Rejected: unknown_session)."""
        if chunks == [1] and getattr(runner, "batchable", False):
            return await self._batch(runner, _Decode(cache, hidden, position, peer, reclaimed, adapter), start, end)
        # Pieces run one after another, exactly as the original steps' did: a replayed
        # history then rebuilds the very same KV cache (one batched prefill would not).
        outputs, offset, seconds = [], 0, 0.0
        sizes = pieces(chunks, fair=self.scheduler.fair)
        inline = self.runs_inline(runner, sizes, end - start)
        for size in sizes:
            piece = hidden[:, offset:offset + size]
            async with self.turn(peer, size) as ticket:
                if reclaimed():
                    raise Rejected(protocol.UNKNOWN_SESSION, "the session was reclaimed for a peer within its "
                                                             "fair share of the KV budget")
                forward = functools.partial(_timed, functools.partial(runner.forward, adapter=adapter), piece, cache,
                                            position + offset, start, end)
                if ticket.preempts:
                    await self._paused_long_forwards()
                    out, took = forward() if inline else await self.workers.run(forward)
                elif self.scheduler.fair:
                    out, took = await self._long_forward(runner, adapter, piece, cache, position + offset, start, end)
                else:
                    out, took = forward() if inline else await self.workers.run(forward)
            outputs.append(out)
            offset += size
            seconds += took
        output = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
        if self.noise > 0:
            output = output + torch.randn_like(output) * self.noise * output.abs().mean()
        self.observe(hidden.shape[1], end - start, seconds)
        return output, seconds

    async def _batch(self, runner: SpanCompute, entry: _Decode, start: int, end: int) -> tuple[torch.Tensor, float]:
        """A one-token step, computed together with the other one-token steps of the
        same span waiting at the same time (model/batched.py). The first to wait
        leads: it takes a compute turn, gives steps that are arriving a moment to
        join, then runs them all as one forward. Alone, a step is exactly the plain
        forward; batched, each output agrees with its forward alone within a
        matrix product's rounding. A member's compute time is its share of the
        batch's."""
        key = (id(runner), start, end)
        group = self._waiting.setdefault(key, [])
        group.append(entry)
        if len(group) > 1:  # a leader is waiting for its turn: it takes this one along
            try:
                await entry.done.wait()
            except trio.Cancelled:
                waiting = self._waiting.get(key, [])
                if entry in waiting:
                    waiting.remove(entry)
                    if entry.lead:  # woken to lead, cancelled first: the next one leads
                        self._hand_over(key)
                else:  # taken into a forward that writes its cache: it ends first
                    with trio.CancelScope(shield=True):
                        await entry.done.wait()
                raise
            if not entry.lead:
                if entry.error is not None:
                    raise entry.error
                return entry.output, entry.seconds
        await self._lead(key, entry, runner, start, end, entry.peer)
        if entry.error is not None:
            raise entry.error
        return entry.output, entry.seconds

    async def _lead(self, key: tuple, entry: _Decode, runner: SpanCompute, start: int, end: int, peer: str) -> None:
        batch: list[_Decode] = []
        try:
            async with self.turn(peer, 1) as ticket:
                for _ in range(JOIN_YIELDS):  # steps whose frames were read meanwhile join
                    await trio.sleep(0)
                waiting = self._waiting.pop(key, [])
                batch, rest = waiting[:_batched().MAX_BATCH], waiting[_batched().MAX_BATCH:]
                if rest:  # the first of the rest leads the next batch
                    self._waiting[key] = rest
                    rest[0].lead = True
                    rest[0].done.set()
                live = []
                for member in batch:
                    if member.reclaimed():
                        member.error = Rejected(protocol.UNKNOWN_SESSION, "the session was reclaimed for a peer "
                                                                          "within its fair share of the KV budget")
                    else:
                        live.append(member)
                if live:  # other peers' steps: the leader's cancellation must not fail them
                    with trio.CancelScope(shield=True):
                        await self._batch_forward(runner, live, start, end, ticket)
        except BaseException as exc:
            if not batch:  # it never took the batch: another waiting step leads instead
                waiting = self._waiting.get(key, [])
                if entry in waiting:
                    waiting.remove(entry)
                self._hand_over(key)
            for member in batch:
                if member.output is None and member.error is None and member is not entry:
                    # Another task's cancellation is not theirs to raise.
                    member.error = exc if isinstance(exc, Exception) else Rejected(
                        protocol.INTERNAL, "the batched forward this step was in was cancelled")
            raise
        finally:
            for member in batch:
                member.done.set()

    def _hand_over(self, key: tuple) -> None:
        """The first step still waiting for `key` leads the next batch (if any waits)."""
        waiting = self._waiting.get(key)
        if waiting:
            waiting[0].lead = True
            waiting[0].done.set()
        elif key in self._waiting:
            del self._waiting[key]

    async def _batch_forward(self, runner: SpanCompute, batch: list[_Decode], start: int, end: int,
                             ticket: Ticket) -> None:
        def forward():
            began = time.perf_counter()
            if len(batch) == 1:  # exactly the plain forward
                one = batch[0]
                outs = [runner.forward(one.hidden, one.cache, one.position, start, end, adapter=one.adapter)]
            else:  # each session's own adapter (or none), in one forward
                outs = _batched().decode_batch(runner, [m.hidden for m in batch], [m.cache for m in batch],
                                    [m.position for m in batch], start, end, [m.adapter for m in batch])
            return outs, time.perf_counter() - began

        inline = len(batch) == 1 and self.runs_inline(runner, [1], end - start)
        if ticket.preempts:
            await self._paused_long_forwards()
        try:
            outs, took = forward() if inline else await self.workers.run(forward)
        except BaseException as exc:
            for member in batch:
                member.error = exc
            raise
        for member, out in zip(batch, outs):
            if self.noise > 0:
                out = out + torch.randn_like(out) * self.noise * out.abs().mean()
            member.output, member.seconds = out, took / len(batch)
        if len(batch) > 1:
            self.batches += 1
            self.batched_steps += len(batch)
        self.observe(len(batch), end - start, took)

    async def _long_forward(self, runner: SpanCompute, adapter, *args) -> tuple[torch.Tensor, float]:
        """A long piece's forward in a worker thread, pausing before each layer while
        short pieces preempt it."""
        return await self._long(lambda pause: _timed(functools.partial(runner.forward, between_layers=pause,
                                                                       adapter=adapter), *args))

    async def _long(self, compute: Callable[[Callable[[], None]], T]) -> T:
        """`compute(pause_point)` in a worker thread (`pause_point` between layers); it counts
        as running from here, so a short piece granted meanwhile waits for its first pause."""
        with self._preempt:
            self._in_long += 1
        try:
            return await self.workers.run(compute, self._pause_point)
        finally:
            with self._preempt:
                self._in_long -= 1
                self._preempt.notify_all()

    async def run_training(self, peer: str, cost_tokens: int, blocks: int,
                           compute: Callable[[Callable[[], None]], T]) -> tuple[T, float]:
        """A training request's `compute(pause_point)`: one long piece (decode steps preempt
        it) in `peer`'s fair turn, costed at `cost_tokens`. Its result and seconds."""
        async with self.turn(peer, max(cost_tokens, SHORT_TOKENS + 1)):
            began = time.perf_counter()
            out = await self._long(compute)
            took = time.perf_counter() - began
        self.observe(cost_tokens, blocks, took)
        return out, took

    def _pause_point(self) -> None:
        with self._preempt:
            if not self.scheduler.preempting:
                return
            self._paused += 1
            self._preempt.notify_all()
            while self.scheduler.preempting:
                self._preempt.wait(PAUSE_POLL_S * 20)  # woken when the short pieces end
            self._paused -= 1

    async def _paused_long_forwards(self) -> None:
        """Before a short piece runs: every long forward has reached a pause point (at
        most one layer away), so the short one has the compute to itself."""
        while True:
            with self._preempt:
                if self._paused >= self._in_long:
                    return
            await trio.sleep(PAUSE_POLL_S)

    @contextlib.asynccontextmanager
    async def turn(self, peer: str, tokens: int):
        """Hold a compute slot for a piece of `tokens` tokens of `peer`'s (the ticket)."""
        ticket = self.scheduler.submit(peer, tokens)
        try:
            self._grant()
            if not ticket.granted:
                event = self._granted[ticket] = trio.Event()
                await event.wait()
            yield ticket
        finally:
            self._granted.pop(ticket, None)
            with self._preempt:
                self.scheduler.done(ticket)
                self._preempt.notify_all()  # paused long forwards look again
            self._grant()

    def _grant(self) -> None:
        with self._preempt:
            granted = self.scheduler.grant()
        for ticket in granted:
            if ticket in self._granted:
                self._granted[ticket].set()

    def runs_inline(self, runner: SpanCompute, chunks: list[int], blocks: int) -> bool:
        """Whether a step runs on the event loop rather than in a worker thread.

        A decode step's forward is hundreds of small torch ops, each releasing the GIL.
        In a worker thread it shares the GIL with this loop's network work (py-libp2p
        is pure Python), which takes the GIL at every op and keeps it for its burst:
        measured, a decode step spends a share of each forward waiting for the GIL and
        the thread hand-off, and a token takes longer than inline. Inline holds the
        loop for the forward's duration, so only short one-token steps qualify,
        predicted from the measured rate; prefills, replays, several compute threads
        and slowed runners stay in threads."""
        if chunks != [1] or self.scheduler.slots != 1 or runner.slowdown > 1.0:
            return False
        return self.block_rate > 0 and blocks / self.block_rate <= INLINE_MAX_S


def _timed(forward, *args) -> tuple[torch.Tensor, float]:
    began = time.perf_counter()
    return forward(*args), time.perf_counter() - began


def wire(tensor: torch.Tensor) -> WireTensor:
    """A tensor as it goes on the wire."""
    encoded = encode_tensor(tensor)
    return WireTensor(encoded["dtype"], tuple(encoded["shape"]), encoded["data"])
