"""The consumer's side of /compushare/infer/1.3.0: a chain of sessions that outlives
its servers.

One stream per hop carries every step of the session. Every request has a deadline
that follows the hop's observed latency, so a hung server is noticed in about a
second, not after a fixed 30 s. The chain keeps what it sent into every block
boundary (`History`). When a hop fails (connection lost, deadline missed, error
reply, wrong answer) the planner names servers covering that hop's blocks, the
history is replayed through them chunk by chunk, exactly as it was first computed
(so their KV caches and outputs are bit-identical to the lost server's), and the
step goes on. A sampled share of steps is also computed by a second server of the
same blocks (spot checks); a mismatch yields a signed failure report and a failover.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import random
import time
from collections.abc import AsyncIterator
from typing import Protocol

import multiaddr
import torch
import trio
from libp2p.abc import IHost
from libp2p.network.stream.exceptions import StreamError
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from ...errors import FrameError, HopFailed, HopUnavailable, PeerMisbehaved, RemoteError, ServerBusy
from ...net.codec import DEFAULT_MAX_FRAME
from ...net.framing import FramedStream
from ...net.tensors import decode_tensor, encode_tensor
from ...karma.receipts import RECEIPT_STEPS, Receipt, parse_receipt, sign_receipt
from .. import protocol
from ...proofs import DEFAULT_TOLERANCE, FailureReport, StepClaim, relative_error
from .routing import Hop
from .spotcheck import Penalties, SpotCheckSchedule

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
MIN_DEADLINE_S = 1.0  # no step is given less (scheduling hiccups on a loaded machine)
DEADLINE_LATENCIES = 5.0  # a step may take this many times the hop's usual latency per chunk...
DEADLINE_PER_TOKEN_S = 0.01  # ... plus this much per token it carries
LATENCY_EWMA = 0.2
FAILOVER_TIMEOUT_S = 60.0  # how long a failed span may stay uncovered before the generation fails
REPLAY_MAX_TOKENS = 2048  # tokens per replay request (the servers' default max_step_tokens)
RECEIPT_TIMEOUT_S = 2.0


def peer_info(hop: Hop) -> PeerInfo:
    addrs = []
    for text in hop.record.addrs:
        addr = multiaddr.Multiaddr(text)
        with contextlib.suppress(Exception):
            addr = addr.decapsulate(multiaddr.Multiaddr(f"/p2p/{hop.peer_id}"))
        addrs.append(addr)
    return PeerInfo(ID.from_base58(hop.peer_id), addrs)


@dataclasses.dataclass
class Usage:
    """A session's steps since its last receipt, as the consumer saw them."""

    seq: int = 0
    steps: int = 0
    tokens: int = 0
    compute_ms: float = 0.0  # what the server reported, each step capped by its wall time
    wall_ms: float = 0.0

    def add(self, tokens: int, compute_ms: float, wall_ms: float) -> None:
        self.steps += 1
        self.tokens += tokens
        self.compute_ms += min(max(compute_ms, 0.0), wall_ms)
        self.wall_ms += wall_ms


@dataclasses.dataclass(frozen=True)
class StepResult:
    output: torch.Tensor  # [1, n, H] (all chunks, or the last one with last_only)
    data: bytes  # the output's wire bytes (what the proof signs)
    dtype: str
    proof: dict | None


class RemoteHop:
    """One open session: its own id, so that one server can hold a hop and a spot
    check (or a replacement) of the same chain."""

    def __init__(self, hop: Hop, framed: FramedStream, hidden_size: int, session_id: bytes) -> None:
        self.hop = hop
        self.session_id = session_id
        self.framed = framed
        self.hidden_size = hidden_size
        self.latency = max(hop.expected_s, 0.005)  # seconds per decode step, observed
        self.usage = Usage()  # what the next receipt covers
        self.linked: tuple = (None, None)  # (upstream peer, downstream hop) as last sent (pipeline/push.py)

    @property
    def peer_id(self) -> str:
        return self.hop.peer_id

    def _where(self) -> str:
        return f"{self.peer_id} (blocks {self.hop.start}:{self.hop.end})"

    def deadline(self, tokens: int, chunks: int = 1) -> float:
        return MIN_DEADLINE_S + DEADLINE_LATENCIES * self.latency * chunks + DEADLINE_PER_TOKEN_S * tokens

    async def request(self, message: dict, timeout: float) -> dict:
        """Send, await the reply; a "rate limited" reply is retried within the deadline.
        Every failure is a HopFailed naming this server."""
        try:
            with trio.fail_after(timeout):
                while True:
                    await self.framed.send(message)
                    reply = await self.framed.receive()
                    if reply is None or reply.get("type") != "error" or reply.get("code") != protocol.RATE_LIMITED:
                        break
                    wait = reply.get("retry_after_s")
                    await trio.sleep(min(float(wait), 5.0) if isinstance(wait, float | int) else 0.1)
        except trio.TooSlowError:
            raise HopFailed(self.peer_id, "timeout", f"{self._where()} did not answer within {timeout:.1f}s") \
                from None
        except (StreamError, FrameError) as exc:
            raise HopFailed(self.peer_id, "connection_lost",
                            f"lost the stream to {self._where()}: {str(exc) or type(exc).__name__}") from None
        if reply is None:
            raise HopFailed(self.peer_id, "closed", f"{self._where()} closed the stream")
        if reply.get("type") == "error":
            code, text = str(reply.get("code")), str(reply.get("message"))
            if code == protocol.BUSY:
                raise ServerBusy(code, f"{self._where()}: {text}")
            raise HopFailed(self.peer_id, code, f"{self._where()}: {text}")
        return reply

    async def step(self, hidden: torch.Tensor, position: int, *,
                   chunks: list[int] | None = None, last_only: bool = False) -> StepResult:
        tokens = hidden.shape[1]
        message = {"type": "step", "session": self.session_id, "position": position, "hidden": encode_tensor(hidden)}
        if chunks is not None and len(chunks) > 1:
            message["chunks"] = chunks
        if last_only:
            message["last_only"] = True
        began = time.perf_counter()
        try:
            reply = await self.request(message, self.deadline(tokens, len(chunks or [tokens])))
        except ServerBusy as exc:  # busy mid-session: as good as gone for this session
            raise HopFailed(self.peer_id, exc.code, exc.message) from None
        expect = chunks[-1] if last_only and chunks else tokens
        try:
            if reply.get("type") != "result" or reply.get("position") != position:
                raise PeerMisbehaved(f"answered step {position} with {reply.get('type')}")
            wire = reply.get("hidden")
            output = decode_tensor(wire, hidden_size=self.hidden_size, max_tokens=expect)
            if output.shape[1] != expect:
                raise PeerMisbehaved(f"returned {output.shape[1]} tokens for {expect}")
        except PeerMisbehaved as exc:
            raise HopFailed(self.peer_id, "bad_reply", f"{self._where()}: {exc}") from None
        wall = time.perf_counter() - began
        if tokens == 1:
            self.latency = (1 - LATENCY_EWMA) * self.latency + LATENCY_EWMA * wall
        compute_ms = reply.get("compute_ms")
        self.usage.add(tokens, float(compute_ms) if isinstance(compute_ms, float | int) else 0.0, wall * 1000)
        proof = reply.get("proof")
        return StepResult(output, wire["data"], wire["dtype"], proof if isinstance(proof, dict) else None)

    async def send_receipt(self, host: IHost, model_id: str) -> None:
        """Sign what this session has run since the last receipt and have the server
        countersign it (its karma). A refusal costs the server only its own credit;
        a hop that does not answer in time is aborted (its stream could deliver the
        late reply in place of the next step's): the next step fails over."""
        usage = self.usage
        if not usage.tokens:
            return
        receipt = Receipt(self.peer_id, host.get_id().to_string(), model_id, self.hop.start, self.hop.end,
                          self.session_id, usage.seq, usage.tokens, min(usage.compute_ms, usage.wall_ms),
                          usage.wall_ms, time.time())
        wire = sign_receipt(receipt, host.get_private_key())
        self.usage = Usage(seq=usage.seq)  # those steps are settled, accepted or not
        try:
            reply = await self.request({"type": "receipt", "session": self.session_id, "receipt": wire},
                                       RECEIPT_TIMEOUT_S)
            parse_receipt(reply.get("receipt"))  # countersigned by the server it names
        except RemoteError as exc:  # HopFailed, or a (misplaced) busy
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
            await self.request({"type": "close", "session": self.session_id}, timeout=1)
            await self.framed.close()

    async def abort(self) -> None:
        with contextlib.suppress(Exception):
            await self.framed.reset()


async def open_hop(host: IHost, hop: Hop, model_id: str, max_tokens: int, hidden_size: int) -> RemoteHop:
    """Dial the server and open a new session on it; every failure is a HopUnavailable."""
    session_id = os.urandom(protocol.SESSION_ID_BYTES)
    try:
        with trio.fail_after(CONNECT_TIMEOUT_S):
            info = peer_info(hop)
            # py-libp2p refuses to redial, for a while, a peer whose addresses failed
            # once: a server restarted on a new port must be reachable at once.
            with contextlib.suppress(Exception):
                host.get_network().unblock_peer(info.peer_id)
            await host.connect(info)
            stream = await host.new_stream(info.peer_id, [protocol.INFER_PROTOCOL])
        remote = RemoteHop(hop, FramedStream(stream, DEFAULT_MAX_FRAME), hidden_size, session_id)
        await remote.request(
            {"type": "open", "session": session_id, "model": model_id, "start": hop.start, "end": hop.end,
             "max_tokens": max_tokens},
            timeout=CONNECT_TIMEOUT_S,
        )
        return remote
    except RemoteError as exc:
        raise HopUnavailable(hop.peer_id, exc.code, exc.message) from None
    except Exception as exc:  # dial and stream failures come in many types
        raise HopUnavailable(hop.peer_id, "unreachable", f"could not reach {hop.peer_id} (blocks "
                             f"{hop.start}:{hop.end}): {str(exc) or type(exc).__name__}") from None


class Planner(Protocol):
    """Where a chain finds servers: the consumer's view of the swarm."""

    penalties: Penalties

    async def plan(self, start: int, end: int, *, deadline: float) -> list[Hop]:
        """A route through blocks start..end-1 avoiding penalised peers; waits (until
        `deadline`, trio time) for one to appear, then raises RouteError."""

    def verifier(self, start: int, end: int, exclude: set[str]) -> Hop | None:
        """A server holding all of start..end-1, for spot checks; None if there is none."""


class History:
    """Every step's input at every block boundary of the chain: enough to replay any hop."""

    def __init__(self) -> None:
        self.sizes: list[int] = []  # tokens per step
        self.inputs: dict[int, list[torch.Tensor]] = {}  # boundary -> one tensor per step

    def at(self, boundary: int) -> list[torch.Tensor]:
        return self.inputs.setdefault(boundary, [])


def _groups(steps: list[torch.Tensor], limit: int = REPLAY_MAX_TOKENS) -> list[list[torch.Tensor]]:
    """Consecutive steps packed into requests of at most `limit` tokens."""
    groups: list[list[torch.Tensor]] = [[]]
    size = 0
    for step in steps:
        if groups[-1] and size + step.shape[1] > limit:
            groups.append([])
            size = 0
        groups[-1].append(step)
        size += step.shape[1]
    return [g for g in groups if g]


@dataclasses.dataclass
class Failover:
    peer_id: str
    start: int
    end: int
    reason: str
    noticed: float  # time.time() when the failure was noticed
    recovered: float = 0.0  # time.time() when the replacement had answered the step
    replacements: tuple[str, ...] = ()


@dataclasses.dataclass
class _Verifier:
    remote: RemoteHop
    fed: int = 0  # steps of the history it has seen


def judge(primary: torch.Tensor, check: torch.Tensor, arbiter: torch.Tensor | None, tolerance: float) -> str:
    """Who is wrong when a spot check disagrees: "primary", "verifier", "both" or
    "neither" (both within the tolerance of a third opinion: a borderline case).
    Without a third opinion the checked server is blamed; with one, whoever the
    third server disagrees with."""
    if arbiter is None:
        return "primary"
    a = arbiter.numpy()
    primary_ok = relative_error(primary.numpy(), a) <= tolerance
    check_ok = relative_error(check.numpy(), a) <= tolerance
    if primary_ok:
        return "neither" if check_ok else "verifier"
    return "primary" if check_ok else "both"


class InferenceChain:
    """An open session on every hop of a route; `step` survives failing hops when the
    chain has a planner."""

    def __init__(self, host: IHost, model_id: str, *, max_tokens: int, hidden_size: int,
                 planner: Planner | None = None, spot_check_rate: float = 0.0,
                 tolerance: float = DEFAULT_TOLERANCE, rng: random.Random | None = None,
                 push: bool = True) -> None:
        self.host = host
        self.push = push  # link the hops so each pushes its output to the next (pipeline/push.py)
        self.model_id = model_id
        self.max_tokens = max_tokens
        self.hidden_size = hidden_size
        self.planner = planner
        self.spot_check_rate = spot_check_rate
        self.tolerance = tolerance
        self.rng = rng or random.Random()
        self.hops: list[RemoteHop] = []
        self.position = 0
        self.history = History()
        self.failovers: list[Failover] = []
        self.reports: list[FailureReport] = []
        self.checks = 0
        self._schedules: dict[tuple[int, int], SpotCheckSchedule] = {}
        self._verifiers: dict[tuple[int, int], _Verifier] = {}
        self._retired: list[RemoteHop] = []

    @property
    def route(self) -> list[Hop]:
        return [remote.hop for remote in self.hops]

    async def _open(self, hop: Hop) -> RemoteHop:
        remote = await open_hop(self.host, hop, self.model_id, self.max_tokens, self.hidden_size)
        if self.planner is not None:
            self.planner.penalties.success(hop.peer_id)  # it answers again: forgive its faults
        return remote

    async def open(self, route: list[Hop]) -> None:
        """Open a session on every hop at once; a hop that fails is replaced (with a planner)."""
        opened: dict[int, RemoteHop | HopFailed] = {}

        async def open_one(index: int, hop: Hop) -> None:
            try:
                opened[index] = await self._open(hop)
            except HopFailed as exc:
                opened[index] = exc

        async with trio.open_nursery() as nursery:
            for index, hop in enumerate(route):
                nursery.start_soon(open_one, index, hop)
        self.hops = []
        for index, hop in enumerate(route):
            result = opened[index]
            if isinstance(result, RemoteHop):
                self.hops.append(result)
                continue
            if self.planner is None:
                raise result
            self._penalise(result)
            log.warning("%s; choosing another server for blocks %d:%d", result, hop.start, hop.end)
            new_hops, _ = await self._rebuild(hop.start, hop.end, [])
            self.hops.extend(new_hops)

    async def step(self, hidden: torch.Tensor) -> torch.Tensor:
        """Run `hidden` [1, n, H] through every hop; the chain's position advances by n."""
        await self._link()
        index = 0
        while index < len(self.hops):
            remote = self.hops[index]
            try:
                output = await self._run_hop(remote, hidden)
            except HopFailed as exc:
                if self.planner is None:
                    raise
                output, replaced = await self._fail_over(index, hidden, exc)
                index += replaced
            else:
                self.history.at(remote.hop.start).append(hidden)
                index += 1
            hidden = output
        self.history.sizes.append(hidden.shape[1])
        self.position += hidden.shape[1]
        due = [remote for remote in self._live() if remote.usage.steps >= RECEIPT_STEPS]
        if due:
            async with trio.open_nursery() as nursery:
                for remote in due:
                    nursery.start_soon(remote.send_receipt, self.host, self.model_id)
        return hidden

    # -- pushes -----------------------------------------------------------------------

    async def _link(self) -> None:
        """Tell each hop its neighbours, so it pushes its output straight to the next
        one (pipeline/push.py); sent when the chain changed (opened, failed over)."""
        if not self.push:
            return
        changed = []
        for index, remote in enumerate(self.hops):
            upstream = self.hops[index - 1].peer_id if index > 0 else None
            downstream = self.hops[index + 1] if index + 1 < len(self.hops) else None
            if remote.linked != (upstream, downstream):
                changed.append((remote, upstream, downstream))
        if changed:
            async with trio.open_nursery() as nursery:
                for remote, upstream, downstream in changed:
                    nursery.start_soon(self._link_one, remote, upstream, downstream)

    @staticmethod
    async def _link_one(remote: RemoteHop, upstream: str | None, downstream: RemoteHop | None) -> None:
        remote.linked = (upstream, downstream)  # also when refused: pushes only save time
        message = {"type": "link", "session": remote.session_id, "upstream": upstream, "downstream": None}
        if downstream is not None:
            message["downstream"] = {"peer": downstream.peer_id, "addrs": list(downstream.hop.record.addrs),
                                     "session": downstream.session_id}
        try:
            await remote.request(message, remote.deadline(1))
        except RemoteError as exc:  # refused (busy, bad request...): the chain works without pushes
            log.debug("%s will not push: %s", remote.peer_id, exc)
            if isinstance(exc, HopFailed) and exc.code in ("timeout", "connection_lost", "closed"):
                await remote.abort()  # a late reply would desync the stream: its next step fails over

    # -- failover ---------------------------------------------------------------------

    def _penalise(self, exc: HopFailed) -> None:
        if self.planner is not None:
            now = time.monotonic()
            if exc.code == "mismatch":
                self.planner.penalties.mismatch(exc.peer_id, now)
            else:
                self.planner.penalties.fault(exc.peer_id, now)

    async def _fail_over(self, index: int, hidden: torch.Tensor, exc: HopFailed) -> tuple[torch.Tensor, int]:
        failed = self.hops[index]
        event = Failover(failed.peer_id, failed.hop.start, failed.hop.end, exc.code, time.time())
        self.failovers.append(event)
        log.warning("%s; failing over blocks %d:%d at position %d", exc, failed.hop.start, failed.hop.end,
                    self.position)
        self._penalise(exc)
        self._retired.append(failed)
        await failed.abort()
        steps = self.history.at(failed.hop.start) + [hidden]
        new_hops, outputs = await self._rebuild(failed.hop.start, failed.hop.end, steps)
        self.hops[index:index + 1] = new_hops
        self.history.at(failed.hop.start).append(hidden)
        event.recovered = time.time()
        event.replacements = tuple(h.peer_id for h in new_hops)
        return outputs[-1], len(new_hops)

    async def _rebuild(self, start: int, end: int, steps: list[torch.Tensor]) \
            -> tuple[list[RemoteHop], list[torch.Tensor]]:
        """Servers covering start..end-1 with `steps` (the inputs at `start`, one per
        step, the last being the current one) replayed through them. Returns the new
        hops and the outputs at `end`, one per step."""
        assert self.planner is not None
        deadline = trio.current_time() + FAILOVER_TIMEOUT_S
        new_hops: list[RemoteHop] = []
        boundaries: dict[int, list[torch.Tensor]] = {}  # new inner boundaries' histories
        position = start
        while position < end:
            route = await self.planner.plan(position, end, deadline=deadline)
            for hop in route:
                remote = None
                try:
                    remote = await self._open(hop)
                    outputs = await self._replay(remote, steps)
                except HopFailed as exc:
                    log.warning("%s; replanning blocks %d:%d", exc, position, end)
                    self._penalise(exc)
                    if remote is not None:  # opened, then failed in the replay
                        self._retired.append(remote)
                        await remote.abort()
                    break
                new_hops.append(remote)
                position = hop.end
                if position < end:
                    boundaries[position] = outputs  # a new boundary inside the span
                steps = outputs
        self.history.inputs.update(boundaries)
        return new_hops, steps

    async def _replay(self, remote: RemoteHop, steps: list[torch.Tensor]) -> list[torch.Tensor]:
        """Send `steps` to a fresh session as chunks of the original sizes; its outputs."""
        outputs: list[torch.Tensor] = []
        position = 0
        for group in _groups(steps):
            sizes = [s.shape[1] for s in group]
            result = await remote.step(torch.cat(group, dim=1), position, chunks=sizes)
            outputs.extend(torch.split(result.output, sizes, dim=1))
            position += sum(sizes)
        return outputs

    # -- spot checks ------------------------------------------------------------------

    async def _run_hop(self, remote: RemoteHop, hidden: torch.Tensor) -> torch.Tensor:
        span = (remote.hop.start, remote.hop.end)
        verifier = None
        if self.planner is not None and self.spot_check_rate > 0:
            schedule = self._schedules.get(span)
            if schedule is None:
                schedule = self._schedules[span] = SpotCheckSchedule(self.spot_check_rate, self.rng)
            if schedule.should_check():
                verifier = await self._verifier(span, remote.peer_id)
        if verifier is None:
            return (await remote.step(hidden, self.position)).output
        self.checks += 1
        results: dict[str, StepResult | Exception] = {}

        async def run(name: str, coro) -> None:
            try:
                results[name] = await coro
            except HopFailed as exc:
                results[name] = exc

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "primary", remote.step(hidden, self.position))
            nursery.start_soon(run, "verifier", self._verify_step(span, verifier, hidden))
        primary, check = results["primary"], results["verifier"]
        if isinstance(primary, Exception):
            raise primary
        if isinstance(check, Exception):
            log.info("spot check of blocks %d:%d skipped: %s", span[0], span[1], check)
            self._drop_verifier(span, check)
            return primary.output
        error = relative_error(primary.output.numpy(), check.output.numpy())
        if error <= self.tolerance:
            return primary.output
        # Two servers disagree. A third one, if there is one, says which is wrong: a
        # lying verifier must not get an honest server excluded.
        arbiter = await self._arbitrate(span, {remote.peer_id, verifier.remote.peer_id}, hidden)
        blamed = judge(primary.output, check.output, arbiter, self.tolerance)
        if blamed == "neither":
            return primary.output
        if blamed == "verifier":
            self._report(verifier.remote, remote, check, primary, hidden.shape[1])
            self._drop_verifier(span, HopFailed(verifier.remote.peer_id, "mismatch", "outvoted"))
            log.warning("the spot check of blocks %d:%d by %s was wrong (a third server agrees with %s)",
                        span[0], span[1], verifier.remote.peer_id, remote.peer_id)
            return primary.output
        self._report(remote, verifier.remote, primary, check, hidden.shape[1])
        if blamed == "both":
            self._drop_verifier(span, HopFailed(verifier.remote.peer_id, "mismatch", "outvoted"))
        raise HopFailed(remote.peer_id, "mismatch",
                        f"{remote.peer_id} (blocks {span[0]}:{span[1]}) answered step {self.position} "
                        f"{error:.2g} away from {verifier.remote.peer_id}'s answer (tolerance {self.tolerance:g}"
                        f"{'' if arbiter is None else ', a third server agreeing'})")

    async def _arbitrate(self, span: tuple[int, int], disputed: set[str], hidden: torch.Tensor) \
            -> torch.Tensor | None:
        """A third server's output for this step (its whole history batched), or None."""
        hop = self.planner.verifier(span[0], span[1], disputed | {r.peer_id for r in self.hops})
        if hop is None:
            return None
        remote = None
        try:  # (open_hop and step turn "busy" into HopFailed)
            remote = await self._open(hop)
            return (await self._verify_step(span, _Verifier(remote), hidden)).output
        except HopFailed as exc:
            log.info("no third opinion on blocks %d:%d: %s", span[0], span[1], exc)
            return None
        finally:
            if remote is not None:
                await remote.close()

    async def _verifier(self, span: tuple[int, int], primary: str) -> _Verifier | None:
        verifier = self._verifiers.get(span)
        if verifier is not None and verifier.remote.peer_id != primary:
            return verifier
        hop = self.planner.verifier(span[0], span[1], {primary} | {r.peer_id for r in self.hops})
        if hop is None:
            return None
        try:
            remote = await self._open(hop)
        except HopFailed as exc:
            log.info("no spot check for blocks %d:%d now: %s", span[0], span[1], exc)
            self._penalise(exc)
            return None
        if verifier is not None:
            await verifier.remote.close()
        verifier = self._verifiers[span] = _Verifier(remote)
        return verifier

    def _drop_verifier(self, span: tuple[int, int], exc: Exception) -> None:
        verifier = self._verifiers.pop(span, None)
        if verifier is not None:
            self._retired.append(verifier.remote)
        if isinstance(exc, HopFailed):
            self._penalise(exc)

    async def _verify_step(self, span: tuple[int, int], verifier: _Verifier, hidden: torch.Tensor) -> StepResult:
        """Bring the verifier's session up to this step (the missed steps batched, which
        costs little and stays within the tolerance), then compute this step."""
        remote = verifier.remote
        missed = self.history.at(span[0])[verifier.fed:]
        position = sum(self.history.sizes[:verifier.fed])
        groups = _groups(missed + [hidden])
        for index, group in enumerate(groups):
            sizes = [s.shape[1] for s in group]
            last = index == len(groups) - 1
            chunks = [sum(sizes[:-1]), sizes[-1]] if last and len(sizes) > 1 else [sum(sizes)]
            result = await remote.step(torch.cat(group, dim=1), position, chunks=chunks, last_only=True)
            position += sum(sizes)
        verifier.fed = len(self.history.sizes) + 1
        return result

    def _report(self, accused: RemoteHop, witness: RemoteHop, primary: StepResult, check: StepResult,
                tokens: int) -> None:
        """Keep a failure report when both answers carry matching signed proofs."""
        proofs = primary.proof, check.proof
        try:
            if None in proofs or proofs[0].get("input_digest") != proofs[1].get("input_digest"):
                raise PeerMisbehaved("the two answers do not carry proofs for the same input")
            report = FailureReport(
                self.model_id, accused.hop.start, accused.hop.end, self.position, tokens,
                proofs[0]["input_digest"],
                StepClaim(accused.peer_id, primary.dtype, primary.data, proofs[0]["sig"]),
                StepClaim(witness.peer_id, check.dtype, check.data, proofs[1]["sig"]),
                tolerance=self.tolerance,
            )
            report.check()
        except (PeerMisbehaved, KeyError, TypeError) as exc:
            log.warning("mismatch on blocks %d:%d without a checkable report: %s", accused.hop.start,
                        accused.hop.end, exc)
            return
        log.warning("failure report %s: %s disagrees with %s on blocks %d:%d", report.digest[:12],
                    accused.peer_id, witness.peer_id, accused.hop.start, accused.hop.end)
        self.reports.append(report)

    def _live(self) -> list[RemoteHop]:
        return self.hops + [v.remote for v in self._verifiers.values()]

    async def close(self) -> None:
        with trio.CancelScope(shield=True), trio.move_on_after(2 + RECEIPT_TIMEOUT_S):
            async with trio.open_nursery() as nursery:  # receipts first: a session's last steps
                for remote in self._live():
                    nursery.start_soon(remote.send_receipt, self.host, self.model_id)
            for remote in self._live():
                await remote.close()
            for remote in self._retired:
                await remote.abort()


@contextlib.asynccontextmanager
async def open_chain(host: IHost, hops: list[Hop], model_id: str, *, max_tokens: int, hidden_size: int,
                     planner: Planner | None = None, spot_check_rate: float = 0.0,
                     rng: random.Random | None = None, push: bool = True) -> AsyncIterator[InferenceChain]:
    chain = InferenceChain(host, model_id, max_tokens=max_tokens, hidden_size=hidden_size, planner=planner,
                           spot_check_rate=spot_check_rate, rng=rng, push=push)
    try:
        await chain.open(hops)
        yield chain
    finally:
        await chain.close()
