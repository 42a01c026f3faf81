"""The butterfly all-reduce of one round over `/compushare/diloco` streams.

A group of n members (sorted) cuts every pseudo-gradient into n parts; member i owns
part i. Each member sends part i of its contribution, in int8 with fp32 scales and a
signed statement (proofs.diloco.Contribution), to member i on its own stream; member
i aggregates what came before its deadline in fp32 (mean or CenteredClip, in peer
order: deterministic), quantizes the result and answers every stream with it. Every
member, the owner included, uses the dequantized answer, so all end bit-identical.

An owner that does not answer (dead, cut off) fails the attempt for everyone: the
next attempt runs without the owners that failed, re-cut into fewer parts. A
contributor that dies only leaves the parts it had not sent out of the average.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import trio
from libp2p.abc import IHost
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID

from .. import wire
from ..proofs.diloco import Contribution, part_digest
from ..errors import PeerMisbehaved
from ..net.dial import dial
from ..net.framing import request_reply
from . import messages
from .aggregate import aggregate
from .group import group_digest, owners
from .parts import bounds
from .quant import Quantized, dequantize, quantize

log = logging.getLogger(__name__)

DILOCO_PROTOCOL = wire.DILOCO
REPLY_MARGIN_S = 10.0  # a contributor waits this much past the owner's deadline for its answer
AVERAGE_BOUND = 8.0  # an owner's average may be at most this many times a member's own part (L2)


@dataclasses.dataclass(frozen=True)
class Entry:
    """One member's contribution to a part, as its owner received it."""
    contribution: Contribution
    signature: bytes
    part: Quantized


@dataclasses.dataclass(frozen=True)
class Attempt:
    run_id: str
    round: int
    attempt: int
    members: tuple[str, ...]  # sorted
    base: bytes  # digest of the outer weights every member starts from

    @property
    def digest(self) -> bytes:
        return group_digest(self.run_id, self.round, self.attempt, self.members)

    def without(self, failed) -> Attempt:
        return Attempt(self.run_id, self.round, self.attempt + 1,
                       tuple(m for m in self.members if m not in failed), self.base)


class OwnerSlot:
    """The part this member owns in one attempt: the contributions in, then the average."""

    def __init__(self, attempt: Attempt, index: int, size: int, method: str, wait_s: float) -> None:
        self.attempt, self.index, self.size, self.method = attempt, index, size, method
        self.deadline = trio.current_time() + wait_s  # from when this member reached the attempt
        self._closing = False
        self.entries: dict[str, Entry] = {}
        self.full = trio.Event()  # every member's part is in
        self.closed = trio.Event()  # the result is set
        self.result: Quantized | None = None

    def admit(self, peer: str, entry: Entry) -> None:
        """Take `peer`'s part (checked against the attempt); PeerMisbehaved otherwise."""
        c = entry.contribution
        if self._closing:
            raise LateError("this part is averaged already")
        if peer not in self.attempt.members or c.peer != peer:
            raise PeerMisbehaved("the contribution is not its sender's, or the sender is not a member")
        if (c.run, c.round, c.base, c.group, c.index, c.parts) != (
                self.attempt.run_id, self.attempt.round, self.attempt.base, self.attempt.digest, self.index,
                len(self.attempt.members)):
            raise PeerMisbehaved("the contribution names another run, round, base, group or part")
        if entry.part.size != self.size or part_digest(entry.part.q, entry.part.scales) != c.part:
            raise PeerMisbehaved("the part does not match its size or its signed digest")
        if c.tokens == 0 and any(entry.part.q):  # a joiner's zero pseudo-gradient: nothing to re-run, so zeros
            raise PeerMisbehaved("a contribution of no tokens must be zeros")
        if not c.verify(entry.signature):
            raise PeerMisbehaved("the contribution's signature does not check out")
        self.entries.setdefault(peer, entry)
        if len(self.entries) == len(self.attempt.members):
            self.full.set()

    async def close(self) -> Quantized:
        """Wait for every member's part (until the deadline), then average what came."""
        with trio.move_on_at(self.deadline):
            await self.full.wait()
        if self._closing:
            await self.closed.wait()
        else:
            self._closing = True
            entries = [self.entries[p] for p in sorted(self.entries)]
            try:
                self.result = await trio.to_thread.run_sync(_average, entries, self.method)
            except BaseException:
                self._closing = False  # cancelled before it averaged: the next caller does it
                raise
            self.closed.set()
        assert self.result is not None
        return self.result


class LateError(Exception):
    pass


def _norm(part: Quantized) -> float:
    return float(torch.linalg.vector_norm(dequantize(part).double()))


def _average(entries: list[Entry], method: str) -> Quantized:
    return quantize(aggregate([dequantize(e.part) for e in entries], method))


@dataclasses.dataclass
class Outcome:
    """What one member got from a round's all-reduce."""
    average: torch.Tensor | None  # None: it failed (the member applies its own pseudo-gradient)
    attempt: Attempt
    slot: OwnerSlot | None  # this member's part in the attempt that succeeded
    sent_bytes: int = 0
    failed: tuple[str, ...] = ()
    receipts: list[tuple[str, bytes]] = dataclasses.field(default_factory=list)  # (owner, consumer-signed)


class AllReduce:
    """A member's side of all-reduces: its own slots (served by the protocol handler,
    diloco/service.py) and its sends."""

    def __init__(self, host: IHost, key_pair: KeyPair, addrs: dict[str, list], *, method: str,
                 wait_s: float, dht=None) -> None:
        self.host, self.key_pair, self.addrs, self.method, self.wait_s = host, key_pair, addrs, method, wait_s
        self.dht = dht  # finds members whose addresses are not known yet
        self.me = ID.from_pubkey(key_pair.public_key).to_base58()
        self.slots: dict[bytes, OwnerSlot] = {}  # by attempt digest: this round's
        self.slot_added = trio.Event()

    def open_slot(self, attempt: Attempt, size: int) -> OwnerSlot:
        index = owners(attempt.members).index(self.me)
        start, end = bounds(size, len(attempt.members))[index]
        slot = OwnerSlot(attempt, index, end - start, self.method, self.wait_s)
        self.slots[attempt.digest] = slot
        self.slot_added.set()
        self.slot_added = trio.Event()
        return slot

    def forget_before(self, round_: int) -> None:
        self.slots = {d: s for d, s in self.slots.items() if s.attempt.round >= round_}

    async def slot_for(self, digest: bytes, wait_s: float) -> OwnerSlot | None:
        """The slot of an attempt this member may not have reached yet."""
        with trio.move_on_after(wait_s):
            while digest not in self.slots:
                await self.slot_added.wait()
        return self.slots.get(digest)

    async def run(self, attempt: Attempt, vector: torch.Tensor, tokens: int, *,
                  attempts_left: int = 2) -> Outcome:
        """Average `vector` with the attempt's members; retry without owners that
        failed while at least two members remain."""
        sent = 0
        while True:
            outcome = await self._once(attempt, vector, tokens)
            sent += outcome.sent_bytes
            outcome.sent_bytes = sent
            if outcome.average is not None or attempts_left <= 0:
                return outcome
            nxt = attempt.without(outcome.failed)
            if len(nxt.members) < 2 or self.me not in nxt.members:
                return outcome
            log.info("round %d: owners %s failed; attempt %d with %d members", attempt.round,
                     [f[:12] for f in outcome.failed], nxt.attempt, len(nxt.members))
            attempt, attempts_left = nxt, attempts_left - 1

    async def _once(self, attempt: Attempt, vector: torch.Tensor, tokens: int) -> Outcome:
        members = owners(attempt.members)
        cuts = bounds(vector.numel(), len(members))
        mine = members.index(self.me)
        slot = self.open_slot(attempt, vector.numel())
        quantized = await trio.to_thread.run_sync(lambda: [quantize(vector[a:b]) for a, b in cuts])
        signed = [self._sign(attempt, i, len(members), tokens, q) for i, q in enumerate(quantized)]
        slot.admit(self.me, Entry(signed[mine][0], signed[mine][1], quantized[mine]))
        results: dict[int, Quantized] = {}
        failed: list[str] = []
        receipts: list[tuple[str, bytes]] = []
        sent = 0

        async def send(i: int) -> None:
            nonlocal sent
            contribution, signature = signed[i]
            request = messages.part_request(attempt.run_id, attempt.round, attempt.attempt, members,
                                            contribution.to_wire(), signature, quantized[i].to_wire())
            sent += len(quantized[i].q) + len(quantized[i].scales)
            try:
                reply = await ask(self.host, self.addrs, members[i], request, self.wait_s + REPLY_MARGIN_S, self.dht)
                if reply.get("type") != "averaged" or not isinstance(reply.get("part"), dict):
                    raise PeerMisbehaved(f"owner answered {reply.get('type')!r}: {reply.get('message')}")
                result = Quantized.from_wire(reply["part"], expected_size=cuts[i][1] - cuts[i][0])
                if tokens > 0 and _norm(result) > AVERAGE_BOUND * _norm(quantized[i]) + 1e-12:
                    # An average is within its contributions' spread: this owner replaced it.
                    raise PeerMisbehaved(f"the owner's average is over {AVERAGE_BOUND}× this member's own part")
                results[i] = result
                if isinstance(reply.get("receipt"), bytes) and reply["receipt"]:
                    receipts.append((members[i], reply["receipt"]))
            except Exception as exc:  # a dead, slow or misbehaving owner fails its part
                log.info("round %d: part %d from %s failed: %s", attempt.round, i, members[i][:12], exc)
                failed.append(members[i])

        async with trio.open_nursery() as nursery:
            for i in range(len(members)):
                if i != mine:
                    nursery.start_soon(send, i)
            results[mine] = await slot.close()
        if failed:
            return Outcome(None, attempt, slot, sent, tuple(sorted(failed)), receipts)
        average = torch.cat([dequantize(results[i]) for i in range(len(members))]) if members else vector
        return Outcome(average, attempt, slot, sent, (), receipts)

    def _sign(self, attempt: Attempt, index: int, parts: int, tokens: int, q: Quantized):
        contribution = Contribution(run=attempt.run_id, round=attempt.round, base=attempt.base, peer=self.me,
                                    group=attempt.digest, index=index, parts=parts, tokens=tokens,
                                    part=part_digest(q.q, q.scales))
        return contribution, contribution.sign(self.key_pair)


async def ask(host: IHost, addrs: dict[str, list], peer: str, request: dict, timeout: float, dht=None) -> dict:
    """One request, one reply on a new `/compushare/diloco` stream; `peer` is dialled at
    the addresses its provider record gave, or (none known) that the DHT finds."""
    with trio.fail_after(timeout):
        peer_id = ID.from_base58(peer)
        if not host.get_network().connections.get(peer_id):
            known = addrs.get(peer) or host.get_peerstore().addrs(peer_id)
            if not known and dht is not None:
                info = await dht.peer_routing.find_peer(peer_id)
                known = list(info.addrs) if info is not None else []
            if known:
                await dial(host, peer_id, known, timeout=timeout)
        reply = await request_reply(host, peer_id, DILOCO_PROTOCOL, request, messages.MAX_FRAME)
    if reply is None:
        raise PeerMisbehaved("the peer closed the stream without answering")
    return reply

