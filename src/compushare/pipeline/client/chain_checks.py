"""Spot checks, sans I/O: which steps a second server of the same blocks recomputes,
how that verifier is found and kept up to date, and, when the two disagree, the
third opinion, the verdict (chain_plan.judge), the report and who is penalised."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from ...errors import HopFailed
from ...proofs import relative_error
from .chain_events import Answered, Close, Failed, FileReport, FindVerifier, OpenSession, Reply, SendSteps, Session
from .chain_machine import Machine, Span
from .chain_plan import Verifier, catch_up_plan, judge
from .routing import Hop
from .spotcheck import SpotCheckSchedule

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Dispute:
    """A spot check that disagreed, awaiting a third opinion."""

    span: Span
    hop: Session
    verifier: Verifier
    primary: Reply
    check: Reply
    error: float


class SpotChecking(Machine):
    def _check_due(self, session: Session) -> bool:
        """Whether this step of `session` is to be checked (draws from its span's
        schedule: once per step and hop)."""
        if not (self.can_fail_over and self.spot_check_rate > 0):
            return False
        span = session.span
        schedule = self.schedules.get(span)
        if schedule is None:
            schedule = self.schedules[span] = SpotCheckSchedule(self.spot_check_rate, self.rng)
        return schedule.should_check()

    def _start_check(self, session: Session) -> None:
        """Begin checking this step of `session`: a verifier is being found, or the
        step is sent to both."""
        span = session.span
        verifier = self.verifiers.get(span)
        if verifier is not None and verifier.session.peer_id != session.peer_id:
            return self._send_hop(verifier)
        exclude = frozenset({session.peer_id} | {h.peer_id for h in self.hops})
        self._request([FindVerifier(*span, exclude)], lambda events: self._verifier_found(span, events[0].hop),
                      "finding a verifier")

    def _verifier_found(self, span: Span, hop: Hop | None) -> None:
        if hop is None:
            return self._send_hop(None)
        session = Session(hop)
        self._request([OpenSession(session)], lambda events: self._verifier_opened(span, session, events[0]),
                      "opening a verifier")

    def _verifier_opened(self, span: Span, session: Session, event) -> None:
        if isinstance(event, Failed):
            log.info("no spot check for blocks %d:%d now: %s", *span, event.error)
            self._penalise(event.error)
            return self._send_hop(None)
        self._opened_ok(session)
        old = self.verifiers.get(span)
        if old is not None:
            self._effect(Close(old.session))
        verifier = self.verifiers[span] = Verifier(session)
        self._send_hop(verifier)

    def _catch_up(self, span: Span, fed: int):
        """The requests bringing a verifier that has seen `fed` steps up to this step,
        then computing it."""
        step = self._step
        return catch_up_plan(self.history.kept(span[0]), self.history.sizes, fed, step.hidden, step.tokens,
                             self.replay_max_tokens)

    def _checked(self, session: Session, verifier: Verifier, primary, check) -> None:
        span = session.span
        self._count(session, primary)
        self._count(verifier.session, check)
        if isinstance(check, Answered):
            verifier.fed = len(self.history.sizes) + 1
        if isinstance(primary, Failed):
            return self._fail_over(primary.error)
        if isinstance(check, Failed):
            log.info("spot check of blocks %d:%d skipped: %s", *span, check.error)
            self._drop_verifier(span, check.error)
            return self._hop_done(primary.replies[0].output)
        mine, theirs = primary.replies[0], check.replies[-1]
        error = relative_error(mine.output.numpy(), theirs.output.numpy())
        if error <= self.tolerance_for(span):
            return self._hop_done(mine.output)
        # Two servers disagree. A third one, if there is one, says which is wrong: a
        # lying verifier must not get an honest server excluded.
        dispute = Dispute(span, session, verifier, mine, theirs, error)
        exclude = frozenset({session.peer_id, verifier.session.peer_id} | {h.peer_id for h in self.hops})
        self._request([FindVerifier(*span, exclude)], lambda events: self._arbiter_found(dispute, events[0].hop),
                      "finding an arbiter")

    def _arbiter_found(self, dispute: Dispute, hop: Hop | None) -> None:
        if hop is None:
            return self._verdict(dispute, None)
        session = Session(hop)
        self._request([OpenSession(session)], lambda events: self._arbiter_opened(dispute, session, events[0]),
                      "opening an arbiter")

    def _arbiter_opened(self, dispute: Dispute, session: Session, event) -> None:
        if isinstance(event, Failed):
            log.info("no third opinion on blocks %d:%d: %s", *dispute.span, event.error)
            return self._verdict(dispute, None)
        self._opened_ok(session)
        self._request([SendSteps(session, self._catch_up(dispute.span, 0))],
                      lambda events: self._arbitrated(dispute, session, events[0]), "arbitrating")

    def _arbitrated(self, dispute: Dispute, session: Session, event) -> None:
        self._effect(Close(session))
        if isinstance(event, Failed):
            log.info("no third opinion on blocks %d:%d: %s", *dispute.span, event.error)
            return self._verdict(dispute, None)
        self._verdict(dispute, event.replies[-1].output)

    def _verdict(self, dispute: Dispute, arbiter: Any) -> None:
        span, hop, verifier = dispute.span, dispute.hop, dispute.verifier
        blamed = judge(dispute.primary.output, dispute.check.output, arbiter, self.tolerance_for(span))
        if blamed == "neither":
            return self._hop_done(dispute.primary.output)
        tokens = self._step.tokens
        if blamed == "verifier":
            self._effect(FileReport(verifier.session, hop, self.position, tokens, dispute.check, dispute.primary))
            self._drop_verifier(span, HopFailed(verifier.session.peer_id, "mismatch", "outvoted"))
            log.warning("the spot check of blocks %d:%d by %s was wrong (a third server agrees with %s)",
                        *span, verifier.session.peer_id, hop.peer_id)
            return self._hop_done(dispute.primary.output)
        self._effect(FileReport(hop, verifier.session, self.position, tokens, dispute.primary, dispute.check))
        if blamed == "both":
            self._drop_verifier(span, HopFailed(verifier.session.peer_id, "mismatch", "outvoted"))
        self._fail_over(HopFailed(
            hop.peer_id, "mismatch",
            f"{hop.peer_id} (blocks {span[0]}:{span[1]}) answered step {self.position} {dispute.error:.2g} away "
            f"from {verifier.session.peer_id}'s answer (tolerance {self.tolerance_for(span):g}"
            f"{'' if arbiter is None else ', a third server agreeing'})"))

    def _drop_verifier(self, span: Span, error: HopFailed) -> None:
        verifier = self.verifiers.pop(span, None)
        if verifier is not None:
            self.retired.append(verifier.session)
        self._penalise(error)
