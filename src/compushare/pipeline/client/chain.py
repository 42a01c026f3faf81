"""The consumer's side of /compushare/infer/1.5.0: a chain of sessions that outlives
its servers.

The chain keeps what it sent into every block boundary. When a hop fails
(connection lost, deadline missed, error reply, wrong answer) the planner names
servers covering that hop's blocks, the history is replayed through them chunk by
chunk, exactly as it was first computed (so their KV caches and outputs are
bit-identical to the lost server's; with `fast_replay`, in few forwards, within the
format's tolerance), and the step goes on. A sampled share of steps
is also computed by a second server of the same blocks (spot checks); a mismatch
yields a signed failure report and a failover.

What to send and what an answer means is decided by the pure core (chain_core.py);
`InferenceChain` here only performs its actions: sessions and streams (hop.py), the
planner, penalties, deadlines, and running a step's requests side by side.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator
from typing import Protocol

import torch
import trio
from libp2p.abc import IHost

from ...errors import HopFailed
from ...model.lora import Adapter
from ...proofs.inference import DEFAULT_MODE, FailureReport
from .. import protocol
from .adapters import AdapterSlices
from .chain_core import ChainCore
from .chain_events import (
    Abort, Answered, Close, Done, Failed, FileReport, FindRoute, FindVerifier, Forgive, HopReply, HopSession, Link,
    OpenSession, Penalise, RouteFound, SendReceipt, SendSteps, SessionOpened, VerifierFound,
)
from .chain_plan import Failover, History, build_report, judge
from .hop import RECEIPT_TIMEOUT_S, Patience, RemoteHop, StepResult, open_hop
from .routing import Hop
from .spotcheck import Penalties

__all__ = ["FAILOVER_TIMEOUT_S", "Failover", "History", "InferenceChain", "Planner", "RemoteHop", "StepResult",
           "judge", "open_chain", "open_hop"]

log = logging.getLogger(__name__)

TIGHTEN_MAX_TOKENS = 16  # direct steps up to this size get a deadline from their upstream's answer
FAILOVER_TIMEOUT_S = 60.0  # how long a failed span may stay uncovered before the generation fails


class Planner(Protocol):
    """Where a chain finds servers: the consumer's view of the swarm."""

    penalties: Penalties

    async def plan(self, start: int, end: int, *, deadline: float) -> list[Hop]:
        """A route through blocks start..end-1 avoiding penalised peers; waits (until
        `deadline`, trio time) for one to appear, then raises RouteError."""

    def verifier(self, start: int, end: int, exclude: set[str]) -> Hop | None:
        """A server holding all of start..end-1, for spot checks; None if there is none."""

    def replaceable(self, start: int, end: int, peer_id: str) -> bool:
        """Whether a route through blocks start..end-1 without `peer_id` is known now."""


class InferenceChain:
    """An open session on every hop of a route; `step` survives failing hops when the
    chain has a planner."""

    def __init__(self, host: IHost, model_id: str, *, max_tokens: int, hidden_size: int,
                 planner: Planner | None = None, spot_check_rate: float = 0.0,
                 tolerance: float | None = None, rng: random.Random | None = None,
                 push: bool = True, direct: bool = True, standby: bool = False, fmt: str | None = None,
                 adapter: Adapter | None = None, fast_replay: bool = False) -> None:
        self.host = host
        self.model_id = model_id
        # The model's weight format: a server that opens a session in another is refused,
        # and spot checks compare outputs within that format's tolerance.
        self.fmt = fmt  # tolerance None: the protocol's for the format and each span (proofs.inference.tolerance)
        self.max_tokens = max_tokens
        self.hidden_size = hidden_size
        self.planner = planner
        self.tolerance = tolerance
        # A LoRA adapter: every session (hop, replacement, standby, spot check) opens with its slice.
        self.adapter = None if adapter is None else AdapterSlices(adapter)
        self.core = ChainCore(can_fail_over=planner is not None, spot_check_rate=spot_check_rate,
                              tolerance=tolerance, rng=rng, push=push, direct=direct, model_id=model_id,
                              mode=fmt or DEFAULT_MODE,
                              standby=standby, fast_replay=fast_replay, adapter_digest=self.adapter and self.adapter.digest,
                              direct_max_tokens=protocol.PUSH_MAX_BYTES // (4 * hidden_size))
        self.reports: list[FailureReport] = []
        self._remotes: dict[HopSession, RemoteHop] = {}
        self._deadline = 0.0  # trio time: the current failover's
        self._answered: dict[HopSession, trio.Event] = {}

    @property
    def hops(self) -> list[RemoteHop]:
        return [self._remotes[session] for session in self.core.hops]

    @property
    def route(self) -> list[Hop]:
        return [session.hop for session in self.core.hops]

    @property
    def position(self) -> int:
        return self.core.position

    @property
    def failovers(self) -> list[Failover]:
        return self.core.failovers

    @property
    def checks(self) -> int:
        return self.core.checks

    async def open(self, route: list[Hop]) -> None:
        """Open a session on every hop at once; a hop that fails is replaced (with a planner)."""
        await self._drive(self.core.open(route))

    async def step(self, hidden: torch.Tensor) -> torch.Tensor:
        """Run `hidden` [1, n, H] through every hop; the chain's position advances by n."""
        await self._drive(self.core.start_step(hidden, hidden.shape[1]))
        return self.core.output

    async def rewind(self, position: int) -> None:
        """Forget every token from `position` on (rejected drafts): each server cuts
        its KV cache back with its next step."""
        await self._drive(self.core.rewind(position))

    async def close(self) -> None:
        live = [self._remotes[session] for session in self.core.live()]
        with trio.CancelScope(shield=True), trio.move_on_after(2 + RECEIPT_TIMEOUT_S):
            async with trio.open_nursery() as nursery:  # receipts first: a session's last steps
                for remote in live:
                    nursery.start_soon(remote.send_receipt, self.host, self.model_id)
            for remote in live:
                await remote.close()
            for session in self.core.retired:
                await self._remotes[session].abort()

    async def abort(self) -> None:
        """Reset every session's stream at once, as a cancelled or interrupted
        generation ends: the user is waiting, and a stream may have a step in flight
        whose reply would stand in for a receipt's. Each server frees the session with
        its stream; the steps since the last receipt go unreceipted."""
        with trio.CancelScope(shield=True), trio.move_on_after(1):
            async with trio.open_nursery() as nursery:  # one stuck reset holds up no other
                for session in list(self.core.live()) + list(self.core.retired):
                    nursery.start_soon(self._remotes[session].abort)

    # -- performing the core's actions -------------------------------------------------

    async def _drive(self, actions: list) -> None:
        """Apply the effects, run the requests (side by side), feed their answers back,
        until the core asks for nothing more."""
        while True:
            requests = []
            for action in actions:
                if isinstance(action, Penalise):
                    penalties = self.planner.penalties
                    (penalties.mismatch if action.kind == "mismatch" else penalties.fault)(action.peer_id,
                                                                                           time.monotonic())
                elif isinstance(action, Forgive):
                    self.planner.penalties.success(action.peer_id)
                elif isinstance(action, Abort):
                    await self._remotes[action.session].abort()
                elif isinstance(action, Close):
                    await self._remotes[action.session].close()
                elif isinstance(action, FileReport):
                    report = build_report(self.core.proof_model(action.accused.hop), action)
                    if report is not None:
                        self.reports.append(report)
                else:
                    requests.append(action)
            if not requests:
                return
            # Set when a session's steps of this batch are answered (direct steps' deadlines).
            self._answered = {r.session: trio.Event() for r in requests if isinstance(r, SendSteps)}
            if len(requests) == 1:
                events = [await self._perform(requests[0])]
            else:
                events = [None] * len(requests)

                async def perform(index: int) -> None:
                    events[index] = await self._perform(requests[index])

                async with trio.open_nursery() as nursery:
                    for index in range(len(requests)):
                        nursery.start_soon(perform, index)
            actions = self.core.feed(events)

    async def _perform(self, request):
        if isinstance(request, SendSteps):
            return await self._send(request)
        if isinstance(request, OpenSession):
            hop = request.session.hop
            try:
                remote = self._remotes[request.session] = await open_hop(
                    self.host, hop, self.model_id, self.max_tokens, self.hidden_size, fmt=self.fmt,
                    adapter=self.adapter and self.adapter.wire(hop.start, hop.end))
            except HopFailed as exc:
                return Failed(exc)
            remote.patience = Patience(self.host, FAILOVER_TIMEOUT_S, lambda: self._replaceable(request.session))
            return SessionOpened()
        if isinstance(request, FindRoute):
            if request.fresh:
                self._deadline = trio.current_time() + FAILOVER_TIMEOUT_S
            return RouteFound(tuple(await self.planner.plan(request.start, request.end, deadline=self._deadline)))
        if isinstance(request, FindVerifier):
            return VerifierFound(self.planner.verifier(request.start, request.end, set(request.exclude)))
        if isinstance(request, Link):
            downstream = None if request.downstream is None else self._remotes[request.downstream]
            return Done(await self._remotes[request.session].link(request.upstream, downstream))
        if isinstance(request, SendReceipt):
            await self._remotes[request.session].send_receipt(self.host, self.model_id)
            return Done()
        raise TypeError(f"not a request: {request!r}")

    async def _send(self, request: SendSteps) -> Answered | Failed:
        """The requests one after another on one session; a failure ends them."""
        remote = self._remotes[request.session]
        replies: list[HopReply] = []
        parts: list[torch.Tensor] = []
        for step in request.requests:
            try:
                if step.from_upstream:
                    # A decode or verify step's push is small and never dropped for room: its
                    # hop gets its own deadline from its upstream's answer. A large one (a
                    # prompt) may be, and then waits for the server's no_input.
                    upstream = self._answered.get(self._upstream_of(request.session)) \
                        if step.chunks[0] <= TIGHTEN_MAX_TOKENS else None
                    result = await remote.step_from_upstream(step.position, step.chunks[0],
                                                             self._upstream_wait(request.session, step.chunks[0]),
                                                             rollback=step.rollback, upstream=upstream)
                else:
                    hidden = step.inputs[0] if len(step.inputs) == 1 else torch.cat(step.inputs, dim=1)
                    result = await remote.step(hidden, step.position, chunks=list(step.chunks),
                                               last_only=step.last_only, rollback=step.rollback)
            except HopFailed as exc:
                return Failed(exc, answered=len(replies))
            replies.append(HopReply(result.output, result.data, result.dtype, result.proof, result.input_digest))
            if not step.last_only:
                parts.extend(torch.split(result.output, list(step.splits or step.chunks), dim=1))
        if request.session in self._answered:  # a direct step's next hop has its own deadline from now
            self._answered[request.session].set()
        return Answered(tuple(replies), tuple(parts))


    def _replaceable(self, session: HopSession) -> bool:
        """Whether a late step of `session` is given up rather than waited for (while
        its server answers pings, hop.Patience): a spot check's or a standby's session
        (dropped without harm), or a hop whose blocks a standby or another server could
        take now. A chain without a planner replaces nothing."""
        if session not in self.core.hops:
            return True
        if self.planner is None:
            return False
        hop = session.hop
        return session.span in self.core.standbys or self.planner.replaceable(hop.start, hop.end, hop.peer_id)

    def _upstream_of(self, session: HopSession) -> HopSession | None:
        index = self.core.hops.index(session)
        return self.core.hops[index - 1] if index > 0 else None

    def _upstream_wait(self, session: HopSession, tokens: int) -> float:
        """How long a hop's server waits for its upstream's push: the deadlines of
        every hop before it (a hop that misses its own is failed over anyway)."""
        index = self.core.hops.index(session)
        return sum(self._remotes[s].deadline(tokens) for s in self.core.hops[:index])


@contextlib.asynccontextmanager
async def open_chain(host: IHost, hops: list[Hop], model_id: str, *, max_tokens: int, hidden_size: int,
                     planner: Planner | None = None, spot_check_rate: float = 0.0,
                     rng: random.Random | None = None, push: bool = True, direct: bool = True,
                     standby: bool = False, fmt: str | None = None, adapter: Adapter | None = None,
                     fast_replay: bool = False) -> AsyncIterator[InferenceChain]:
    """`adapter`: a LoRA adapter every server applies to this chain's sessions (checked
    against the model before: model/adapter_file.load). `fast_replay`: a failover
    without a standby replays the history in few forwards, within the format's
    tolerance instead of bit-identically (chain_plan.replay_plan)."""
    chain = InferenceChain(host, model_id, max_tokens=max_tokens, hidden_size=hidden_size, planner=planner,
                           spot_check_rate=spot_check_rate, rng=rng, push=push, direct=direct, standby=standby,
                           fmt=fmt, adapter=adapter, fast_replay=fast_replay)
    try:
        await chain.open(hops)
        yield chain
    except BaseException as exc:
        if isinstance(exc, Exception):  # an error: the sessions are still settled and closed
            await chain.close()
        else:  # cancelled or interrupted (Ctrl-C): no round trip more, see abort()
            await chain.abort()
        raise
    else:
        await chain.close()
