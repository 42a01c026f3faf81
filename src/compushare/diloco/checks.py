"""Re-running other participants' rounds, and what a mismatch leads to.

Minibatches derive from public seeds and the inner optimizer starts fresh every
round, so a round is a function of the outer weights, the recipe, the run id, the
peer id and the round number: anyone can re-run it. After each round, group.checks
names (checker, target) pairs; a checker re-runs its target's round in a worker
thread and compares the part of the target's contribution it received (as that
part's owner) with its own recomputation. Beyond proofs.diloco.TOLERANCE it signs a
DilocoFailureReport, keeps it with its karma (the witness serves it), excludes the
target from later rounds and sends the report to the round's members.

A report proves that two peers disagree, not which one lied. So a member that
receives one re-runs the part itself (it keeps the last rounds' starting weights)
and excludes whichever of the two its own recomputation contradicts: a witness that
accuses an honest peer only gets itself excluded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import trio
from libp2p.crypto.keys import KeyPair

from ..proofs.diloco import TOLERANCE, DilocoFailureReport, part_error
from ..errors import PeerMisbehaved
from . import messages
from .allreduce import Attempt, OwnerSlot, ask
from .corpus import Corpus
from .group import checks
from .inner import build_model, train_round
from .parts import bounds
from .quant import Quantized, quantize
from .rounds import Rounds
from .weights import weights_digest

log = logging.getLogger(__name__)

KEEP_STARTS = 4  # rounds whose starting weights are kept, to re-run them
MAX_PENDING_JUDGES = 2  # reports waiting for (or in) a re-run at once; more are refused


class Checker:
    """A participant's checks and judgements. It is handed what they read (the run,
    through `rounds` the peers and how to reach them, the current `members`) and
    `exclude`, which drops a peer from the participant's rounds and keeps the report
    that proves it wrong, if any."""

    def __init__(self, rounds: Rounds, corpus: Corpus, key_pair: KeyPair, members: Callable[[], set[str]],
                 exclude: Callable[[str, DilocoFailureReport | None], None]) -> None:
        self.rounds, self.run, self.corpus, self.key_pair = rounds, rounds.run, corpus, key_pair
        self._members, self._exclude_from_rounds = members, exclude
        self.nursery: trio.Nursery | None = None  # the participant's, set when it starts
        self.starts: dict[int, torch.Tensor] = {}  # round -> the outer weights it started from
        self.bases: dict[int, bytes] = {}  # round -> their digest
        self.members: dict[int, set[str]] = {}  # round -> the members of its all-reduce
        self.judged: set[tuple[int, str]] = set()  # (round, accused) re-run for a report already
        self.pending = 0
        self.lock = trio.Lock()  # one re-run at a time: it costs a whole round of compute
        self.model = None

    def schedule(self, round_: int, start: torch.Tensor, attempt: Attempt, slot: OwnerSlot | None) -> None:
        self.starts[round_], self.bases[round_] = start, weights_digest(start)
        self.members[round_] = set(attempt.members)
        for old in [r for r in self.starts if r <= round_ - KEEP_STARTS]:
            del self.starts[old], self.bases[old], self.members[old]
        if slot is None or self.nursery is None:
            return
        for checker, target in checks(self.run.run_id, round_, attempt.members, self.run.check_rate):
            entry = slot.entries.get(target)
            if checker == self.rounds.me and entry is not None and entry.contribution.tokens > 0:
                self.nursery.start_soon(self._guarded, self._check, round_, slot, target)

    async def _guarded(self, fn, *args) -> None:
        """A check or a judgement that fails (a bad re-run, a full disk) costs only itself."""
        try:
            await fn(*args)
        except Exception as exc:
            log.warning("a check failed: %s", exc)

    async def _rerun_part(self, round_: int, peer: str, index: int, parts: int) -> Quantized | None:
        """`peer`'s part `index` of `parts` in `round_`, recomputed here (None: its start is gone)."""
        start = self.starts.get(round_)
        if start is None:
            return None
        async with self.lock:
            if self.model is None:
                self.model = build_model(self.run.recipe)
            result = await trio.to_thread.run_sync(lambda: train_round(
                self.run.recipe, self.corpus, start, run_id=self.run.run_id, peer=peer, round=round_,
                model=self.model))
        a, b = bounds(result.pseudo_grad.numel(), parts)[index]
        return quantize(result.pseudo_grad[a:b])

    async def _check(self, round_: int, slot: OwnerSlot, target: str) -> None:
        entry = slot.entries[target]
        mine = await self._rerun_part(round_, target, slot.index, len(slot.attempt.members))
        if mine is None:
            return
        error = part_error(entry.part.q, entry.part.scales, mine.q, mine.scales)
        log.info("round %d: checked %s: relative error %.3g", round_, target[:12], error)
        if error <= TOLERANCE:
            return
        claim = entry.contribution.claim(entry.signature, entry.part.q, entry.part.scales)
        report = DilocoFailureReport.witnessed(self.key_pair, entry.contribution, claim, mine.q, mine.scales)
        report.check()
        self._exclude(target, report)
        await self._tell_members(report, {target})

    def _exclude(self, peer: str, report: DilocoFailureReport) -> None:
        if peer not in self.rounds.excluded:
            log.warning("excluding %s from run %s: %s", peer[:12], self.run.run_id[:12], "its round does not re-run")
        self._exclude_from_rounds(peer, report)

    async def _tell_members(self, report: DilocoFailureReport, skip: set[str]) -> None:
        rounds = self.rounds
        request = messages.report_request(report.to_wire())

        async def one(peer: str) -> None:
            try:
                await ask(rounds.host, rounds.addrs, peer, request, 30.0, rounds.dht)
            except Exception as exc:
                log.info("report to %s: %s", peer[:12], exc)

        async with trio.open_nursery() as nursery:
            for peer in sorted(self._members() - skip - {rounds.me}):
                nursery.start_soon(one, peer)

    async def take_report(self, sender: str, data: object) -> dict:
        """A report from its witness, a member of the round it is about, on a round whose
        start this peer keeps and started from too: checked, then judged by re-running the
        part here (once per round and accused, a few at a time). Anything else is refused:
        a re-run costs a whole round of compute."""
        if not isinstance(data, bytes):
            raise PeerMisbehaved("'report' must be bytes")
        report = DilocoFailureReport.from_wire(data)
        accused, witness, round_ = report.accused.peer_id, report.witness.peer_id, report.round
        if (report.run != self.run.run_id or sender != witness or report.tokens <= 0
                or not {accused, witness} <= self.members.get(round_, set()) or self.bases.get(round_) != report.base):
            raise PeerMisbehaved("a report this peer does not judge: another run or round, not from its witness, "
                                 "or on members or weights it did not average with")
        if (round_, accused) in self.judged or self.pending >= MAX_PENDING_JUDGES or self.nursery is None:
            return {"type": "ok", "new": False}
        await trio.to_thread.run_sync(report.check)
        self.judged.add((round_, accused))
        self.pending += 1
        self.nursery.start_soon(self._guarded, self._judge, report)
        return {"type": "ok", "new": True}

    async def _judge(self, report: DilocoFailureReport) -> None:
        try:
            await self._judged(report)
        finally:
            self.pending -= 1

    async def _judged(self, report: DilocoFailureReport) -> None:
        accused, witness = report.accused.peer_id, report.witness.peer_id
        if accused in self.rounds.excluded or witness in self.rounds.excluded:
            return
        mine = await self._rerun_part(report.round, accused, report.index, report.parts)
        if mine is None:
            log.info("a report on round %d: its start is no longer kept; not judged", report.round)
            return
        if part_error(report.accused.q, report.accused.scales, mine.q, mine.scales) > TOLERANCE:
            self._exclude(accused, report)
        elif part_error(report.witness.q, report.witness.scales, mine.q, mine.scales) > TOLERANCE:
            log.warning("the witness %s accused %s wrongly", witness[:12], accused[:12])
            self._exclude_from_rounds(witness, None)
